"""A CPU-backed fake accelerator for tests: tensors on ``fakegpu:0`` that hold CPU data and obey CUDA's rules.

flowrl has never run on a GPU, and on the CPU a tensor on the wrong device cannot be noticed: there is one device.
This module registers a second device, ``fakegpu``, whose tensors claim that device (``t.device ==
torch.device("fakegpu", 0)``, ``t.is_cpu is False``, ``t.is_cuda is False``), compute with the real CPU kernels, and
refuse to be mixed with CPU tensors where CUDA refuses. A test runs the training code "on the device" and finds
device bugs: ``torch.cat([device_tensor, cpu_tensor])``, a CPU tensor indexed by a device mask, an EMA copy left on
the CPU, a CPU ``torch.Generator`` drawing noise for a device tensor. It also counts the host/device traffic the
code would cause on a GPU (copies both ways, scalar reads, data-dependent syncs), each with the line that caused it.

Usage (tests only; flowrl's own code never imports this module)::

    from flowrl.testing import fake_accelerator as fa

    device = fa.install()                      # idempotent; == fa.DEVICE == torch.device("fakegpu", 0)
    model.to(device)                           # Parameters keep their identity (an optimizer made before is fine)
    with fa.count_syncs() as syncs:            # or count_syncs(fail_on=["scalar_read"]) to raise at the line
        loss = model(batch.to(device)).mean()
        loss.backward()
        print(loss.item())
    assert syncs.scalar_reads == 1, syncs.summary()   # "1 scalar_read: tests/x.py:12" ...

Design
------
:func:`install` makes the ``PrivateUse1`` dispatch key a Python backend named ``fakegpu``
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``). A tensor on the device is a
:class:`FakeDeviceTensor`, a wrapper tensor subclass (``torch.Tensor._make_wrapper_subclass``) with the device's
sizes, strides and dtype whose data is a plain CPU tensor, ``t._cpu``. Autograd runs on the wrappers (they carry
``requires_grad``, ``.grad`` and the graph); below autograd every ATen op on a wrapper reaches
``FakeDeviceTensor.__torch_dispatch__``, which

1. unwraps the arguments to their CPU tensors, checking devices as CUDA would (rules below),
2. runs the real CPU kernel,
3. wraps the tensor results. In-place and ``out=`` ops write into the held CPU tensor and return the very wrapper
   passed in; a view is a wrapper around a view of the held CPU tensor, so ``x[0].add_(1)`` changes ``x``. An op that
   changes a wrapper's shape in place (``resize_``, ``set_``, ``t_``, an ``out=`` that gets resized) re-syncs the
   wrapper's metadata from its CPU tensor.

Factories called with ``device="fakegpu"`` and no tensor argument reach the ``PrivateUse1`` kernels:
``empty.memory_format`` and ``empty_strided`` return wrappers (``zeros``, ``ones``, ``full``, ``randn``, ``arange``,
``x.to(DEVICE)`` ... are built on them by torch), ``_copy_from``/``_copy_from_and_resize`` serve the copies torch makes
with the Python key excluded (``torch.tensor(data, device=...)``, ``x[[0, 2]]``), and a ``PrivateUse1`` fallback runs
any other factory (``tril_indices`` ...) on the CPU and wraps the result.

Device rules
------------
As CUDA does them (CUDA's messages with ``cuda`` read ``fakegpu``; all ``RuntimeError``):

- Ops whose ``native_functions.yaml`` entry says ``device_check: NoCheck`` (TensorIterator ops: arithmetic,
  comparisons, ``where``, ``lerp``, ``addcmul``, ``_foreach_*`` ...): one device, except that a **0-dim CPU tensor**
  may be an input, passed to the kernel as a scalar (``device_tensor * torch.tensor(2.0)`` works). One per op
  ("Trying to pass too many CPU scalars to non-CPU kernel!"); ``where`` and ``_foreach_*`` take any number.
  Otherwise "Expected all tensors to be on the same device, but found at least two devices, fakegpu:0 and cpu!".
- All other ops (``cat``, ``stack``, ``mm``, ``addmm``, ``convolution``, ``gather``, ``scatter``, ``index_select``,
  ``index_add_``, ``take``, ``embedding``, ``clamp(min=tensor)`` ...) get the check CUDA's generated kernel wrappers
  make: every positional or ``out=`` tensor on one device, 0-dim CPU tensors included: "Expected all tensors to be
  on the same device, but got tensors is on cpu, different from other tensors on fakegpu:0 (when checking argument
  in method wrapper_fakegpu_cat)".
- ``copy_`` and ``.to()``/``_to_copy`` cross devices: a host-to-device or device-to-host copy.
- ``index`` (``t[idx]``): a device tensor takes CPU or device indices (a CPU index is copied to the device, as in
  ATen's ``make_info``); a CPU tensor indexed by a device tensor raises "indices should be either on cpu or on the
  same device as the indexed tensor (cpu)".
- ``index_put_`` (``t[idx] = v``): indices on either device (copied to ``t``'s device); ``v`` on ``t``'s device
  unless 0-dim ("Expected all tensors to be on the same device ..."; with ``accumulate=True`` "expected device
  fakegpu:0 but got device cpu for value tensor").
- ``masked_fill``: self and mask on one device, 0-dim masks included ("expected self and mask to be on the same
  device, but got mask on cpu and self on fakegpu:0"); a tensor value must be 0-dim and may sit on the CPU; a
  device value is read with ``.item()``; a CPU self with a device value raises "masked_fill_: Expected inputs to be
  on same device".
- A random op filling a device tensor with ``generator=`` a CPU ``torch.Generator`` raises "Expected a 'fakegpu'
  device type for generator but found 'cpu'".

Random numbers
--------------
``torch.Generator(device="fakegpu")`` cannot be made: the Python backend API has no hook for ``getNewGenerator``
(it raises ``NotImplementedError``). :func:`fake_generator` returns a ``torch.Generator`` subclass whose ``.device``
reads ``fakegpu:0`` and which device ops accept. Underneath it is a CPU generator; ``__torch_dispatch__`` sees a
plain ``torch.Generator`` for it, so it is recognised by its seed (a 24-bit tag in the top bits of the seed that
``manual_seed`` stores). Device ops given no generator draw from the device's own default generator, separate from
the CPU one as on CUDA: ``torch.manual_seed(s)`` seeds both, and ``torch.fakegpu.get_rng_state()``/
``set_rng_state()``/``torch.random.fork_rng(device_type="fakegpu")`` work. Device seeds are scrambled, so, as on a
GPU, ``torch.randn(n, device=DEVICE)`` after ``torch.manual_seed(0)`` is not the CPU's draw.

Counting syncs
--------------
:func:`count_syncs` yields a :class:`SyncCounter` recording, from every thread (the backward pass runs in
autograd's device thread), each

- ``"d2h"``: device-to-host copy: ``.cpu()``, ``.to("cpu")``, ``cpu_t.copy_(device_t)``, ``numpy(force=True)``,
  printing a device tensor, ``torch.save`` of one;
- ``"h2d"``: host-to-device copy: ``.to(DEVICE)``, ``device_t.copy_(cpu_t)``, ``torch.tensor(data, device=DEVICE)``,
  a CPU index tensor (or a Python list index) used on a device tensor, ``load_state_dict`` into device parameters;
- ``"scalar_read"``: ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` / ``if t:``, ``f"{t:.3f}"``, ``.tolist()`` (all
  but ``tolist`` go through ``aten._local_scalar_dense``);
- ``"sync"``: an op whose output size depends on device data (``nonzero``, ``masked_select``, ``unique``, a device
  bool-mask index or index_put, ``repeat_interleave`` without ``output_size``, ``bincount``, ``equal``) and
  ``torch.fakegpu.synchronize()``,

each with the ``path:line`` of the first stack frame outside torch and this module (``<autograd backward>`` for
events in the backward pass, whose thread has no user frame).

Deviations from CUDA (known)
----------------------------
- A generator passed to a CPU op is not checked: ``torch.randn(3, generator=fake_generator(0))`` works (CUDA
  refuses a CUDA generator for a CPU tensor). ``torch.Generator(device="fakegpu")`` raises.
- Numerics are the CPU kernels' (no TF32); ``scaled_dot_product_attention`` runs its math backend (equal to the CPU
  result up to rounding); fused AdamW runs the CPU fused kernel. Autocast follows CUDA's op lists (lower precision
  for matmuls/convolutions/attention, float32 for norms/softmax/losses/reductions, promotion for ``addcmul`` ...)
  but keeps no cast cache.
- A CPU 0-dim tensor that requires grad, used in a device op while grad is enabled, raises
  ``NotImplementedError``: CUDA moves its 0-dim gradient back to the CPU, but the autograd engine leaves a wrapper
  subclass's gradient where it is and then fails an internal assert in the backward pass.
- ``module.to("cpu")`` from the device makes new ``Parameter`` objects (CUDA keeps them; :func:`to_cpu` and
  :func:`on_device` keep them). ``module.to(DEVICE)`` keeps them, through ``torch.utils.swap_tensors`` (the wrappers
  are "traceable" subclasses), which refuses a Parameter that has a weakref. ``param.data = t`` across devices
  raises ("incompatible tensor type"); CUDA allows it.
- ``data_ptr()``/``untyped_storage()`` are the CPU tensor's (safetensors sees real, distinct storages); the storage
  reads ``device == cpu``.
- ``torch.save`` stores a device tensor as a CPU copy rebuilt by ``torch._utils._rebuild_device_tensor_from_cpu_tensor``
  (``torch.load`` puts it on the device, or on the CPU with ``map_location="cpu"``); tensors that shared storage
  when saved do not after loading.
- No streams, events, memory statistics or pinned memory; ``non_blocking=True`` copies are synchronous (and
  counted). Syncs that CUDA kernels make internally beyond the ops listed above are not counted.
- Process-wide effects of :func:`install` (cannot be undone): ``torch.accelerator.current_accelerator()`` becomes
  ``fakegpu`` and ``tensor.pin_memory()`` raises; ``torch.accelerator.is_available()`` stays False (the device
  module says unavailable) so accelerate, diffusers and ``DataLoader(pin_memory=True)`` keep choosing the CPU
  unless told otherwise. A registered PrivateUse1 backend breaks backward passes over real CUDA tensors
  (pytorch#161129), so :func:`install` refuses to run where CUDA is available unless ``allow_with_cuda=True``.

torch internals relied on (fragile across versions): ``_setup_privateuseone_for_python_backend`` and the
``torch._C._acc`` hooks; ``Tensor._make_wrapper_subclass`` and ``__torch_dispatch__`` (with
``_disabled_torch_function_impl`` and ``__tensor_flatten__``, which ``Module._apply`` reads); ``torch.library``
``PrivateUse1``/``AutocastPrivateUse1`` kernels and ``fallback``; op schemas' alias annotations and tags
(``inplace_view``, ``nondeterministic_seeded``, ``pointwise``); ``torchgen/packaged/ATen/native/native_functions.yaml``
(``device_check: NoCheck``); the C-level ``torch._C.TensorBase.data`` setter to re-sync a wrapper's metadata;
``torch._utils._rebuild_device_tensor_from_cpu_tensor`` and ``_rebuild_parameter``; ``torch.random`` calling the
device module's ``manual_seed_all``; CUDA's error messages and autocast lists as of torch 2.14.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import sys
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

__all__ = ["DEVICE_TYPE", "DEVICE",  # noqa: F822  (DEVICE is provided by the module __getattr__ at the end)
           "install", "is_installed", "is_fake", "FakeDeviceTensor", "to_device", "to_cpu",
           "on_device", "fake_generator", "FakeDeviceGenerator", "count_syncs", "SyncCounter", "SyncEvent",
           "SyncError", "KINDS"]

#: The fake device's type name (``torch.device(DEVICE_TYPE).type``); one device, index 0.
DEVICE_TYPE = "fakegpu"
# ``DEVICE`` (``fakegpu:0``) is a module attribute computed on first access (see __getattr__ at the end): torch
# refuses ``torch.device("fakegpu")`` until the backend is registered, and reading it installs the backend.
_DEVICE: torch.device | None = None
_DEVICE_STR = f"{DEVICE_TYPE}:0"

#: Event kinds a :class:`SyncCounter` records.
KINDS = ("d2h", "h2d", "scalar_read", "sync")

_install_lock = threading.Lock()
_installed = False
_libraries: list[torch.library.Library] = []  # kept alive: a Library's registrations die with it

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)


# ---------------------------------------------------------------------------------------------------------------
# Sync counting
# ---------------------------------------------------------------------------------------------------------------

class SyncEvent(NamedTuple):
    """One host/device interaction: ``kind`` (one of :data:`KINDS`) and ``where`` (``path:line`` of the first
    frame outside torch and this module, the path relative to the working directory when under it)."""
    kind: str
    where: str


class SyncError(RuntimeError):
    """Raised at the offending line by a :func:`count_syncs` context given ``fail_on`` kinds."""


class SyncCounter:
    """The host/device interactions recorded while a :func:`count_syncs` context was open.

    Thread-safe: events come from every thread, including autograd's device thread during ``backward()``.
    """

    def __init__(self, fail_on: Iterable[str] = ()):
        self.fail_on = frozenset(fail_on)
        unknown = self.fail_on - set(KINDS)
        if unknown:
            raise ValueError(f"unknown sync kinds {sorted(unknown)}; use {KINDS}")
        self._events: list[SyncEvent] = []
        self._lock = threading.Lock()

    def _add(self, event: SyncEvent) -> None:
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[SyncEvent]:
        """All events, oldest first (a copy)."""
        with self._lock:
            return list(self._events)

    def count(self, kind: str | None = None) -> int:
        """How many events of ``kind`` (all kinds when None)."""
        with self._lock:
            return sum(1 for e in self._events if kind is None or e.kind == kind)

    @property
    def d2h(self) -> int:
        """Device-to-host copies."""
        return self.count("d2h")

    @property
    def h2d(self) -> int:
        """Host-to-device copies."""
        return self.count("h2d")

    @property
    def scalar_reads(self) -> int:
        """``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()`` ... on device tensors."""
        return self.count("scalar_read")

    @property
    def syncs(self) -> int:
        """Ops whose output shape depends on device data (``nonzero``, mask indexing, ...) and explicit syncs."""
        return self.count("sync")

    @property
    def total(self) -> int:
        """All events."""
        return self.count()

    def by_site(self, kind: str | None = None) -> Counter:
        """``Counter`` of ``(kind, where)`` (of ``where`` alone when ``kind`` is given)."""
        with self._lock:
            if kind is None:
                return Counter((e.kind, e.where) for e in self._events)
            return Counter(e.where for e in self._events if e.kind == kind)

    def clear(self) -> None:
        """Forget the events recorded so far."""
        with self._lock:
            self._events.clear()

    def summary(self) -> str:
        """A readable table, e.g. ``12 d2h: samplers/steps.py:88 (x10), flowrl/rl/forward.py:40 (x2)``."""
        lines = []
        for kind in KINDS:
            sites = self.by_site(kind)
            if not sites:
                continue
            n = sum(sites.values())
            where = ", ".join(f"{site} (x{c})" if c > 1 else site for site, c in sites.most_common())
            lines.append(f"{n} {kind}: {where}")
        return "\n".join(lines) if lines else "no host/device syncs"

    def __repr__(self) -> str:
        return (f"SyncCounter(d2h={self.d2h}, h2d={self.h2d}, scalar_reads={self.scalar_reads}, "
                f"syncs={self.syncs})")


_counters: list[SyncCounter] = []
_counters_lock = threading.Lock()


@contextlib.contextmanager
def count_syncs(fail_on: Iterable[str] = ()) -> Iterator[SyncCounter]:
    """Record the host/device interactions of the code in the ``with`` block (all threads).

    Args:
        fail_on: kinds (of :data:`KINDS`) that raise :class:`SyncError` at the offending line instead of only
            being counted, like ``torch.cuda.set_sync_debug_mode("error")``.

    Yields:
        The :class:`SyncCounter`; it keeps its events after the block. Nested contexts all record.
    """
    counter = SyncCounter(fail_on)
    with _counters_lock:
        _counters.append(counter)
    try:
        yield counter
    finally:
        with _counters_lock:
            _counters.remove(counter)


def _where() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_TORCH_DIR) or filename == _THIS_FILE):
            if os.path.isabs(filename):
                rel = os.path.relpath(filename)
                if not rel.startswith(".."):
                    filename = rel
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    # Only torch frames: autograd's device thread runs the backward pass with no user frame on its stack.
    return "<autograd backward>"


def _record(kind: str) -> None:
    if not _counters:
        return
    event = SyncEvent(kind, _where())
    with _counters_lock:
        counters = list(_counters)
    for counter in counters:
        counter._add(event)
    for counter in counters:
        if kind in counter.fail_on:
            raise SyncError(f"{kind} on {DEVICE_TYPE} at {event.where} "
                            f"(count_syncs(fail_on={sorted(counter.fail_on)}))")


# ---------------------------------------------------------------------------------------------------------------
# The wrapper tensor
# ---------------------------------------------------------------------------------------------------------------

_make_wrapper = torch.Tensor._make_wrapper_subclass
_set_data = torch._C.TensorBase.data.__set__  # the C-level ``t.data = other`` (shallow-copies metadata)


def _wrap(cpu: torch.Tensor) -> FakeDeviceTensor:
    """A device tensor holding ``cpu`` (shared, not copied)."""
    out = _make_wrapper(FakeDeviceTensor, cpu.size(), strides=cpu.stride(), storage_offset=cpu.storage_offset(),
                        dtype=cpu.dtype, layout=cpu.layout, device=_DEVICE, requires_grad=False)
    out._cpu = cpu
    return out


def _resync(wrapper: FakeDeviceTensor) -> None:
    """Make ``wrapper``'s sizes/strides match its CPU tensor again after an op changed them in place."""
    cpu = wrapper._cpu
    if (wrapper.shape == cpu.shape and wrapper.stride() == cpu.stride()
            and wrapper.storage_offset() == cpu.storage_offset()):
        return
    # ``t.data = other`` shallow-copies the TensorImpl metadata (both are wrappers of this class, so the types
    # are compatible); the C++ setter bypasses FakeDeviceTensor.data's Python setter, so re-attach ``_cpu``.
    with torch.no_grad():
        _set_data(wrapper, _wrap(cpu))
    wrapper._cpu = cpu


class FakeDeviceTensor(torch.Tensor):
    """A tensor on ``fakegpu:0`` whose data is the CPU tensor ``self._cpu``.

    Create one with ``t.to(DEVICE)``, ``torch.zeros(..., device=DEVICE)`` and the like, never directly.
    """

    _cpu: torch.Tensor
    # No subclass conversion of results at the torch-function level: __torch_dispatch__ returns the right types,
    # and the default would turn a ``.cpu()`` result back into this class.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, cpu: torch.Tensor):
        return _wrap(cpu)

    # ``is_traceable_wrapper_subclass`` -> Module._apply moves Parameters with swap_tensors (keeps identity).
    def __tensor_flatten__(self):
        return ["_cpu"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return _wrap(inner_tensors["_cpu"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        policy = _POLICIES.get(func)
        if policy is None:
            policy = _policy(func)
        return policy.handler(func, policy, args, kwargs or {})

    # -- the few Python-level behaviours that do not go through an ATen op -------------------------------------

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        # ``param.data = other`` (Module._apply, user code): the C setter copies sizes/dtype, not our _cpu.
        _set_data(self, new)
        if type(new) is FakeDeviceTensor:
            self._cpu = new._cpu

    def __repr__(self, *, tensor_contents=None):
        _record("d2h")  # printing copies the data to the host
        text = repr(self._cpu)  # "tensor(<data>[, size=...][, dtype=...])"
        # torch's order: data, device, size, dtype, then grad_fn / requires_grad.
        cut = min((i for i in (text.find(", size="), text.find(", dtype=")) if i >= 0), default=len(text) - 1)
        text = f"{text[:cut]}, device='{_DEVICE_STR}'{text[cut:]}"
        if self.grad_fn is not None:
            text = f"{text[:-1]}, grad_fn=<{type(self.grad_fn).__name__}>)"
        elif self.requires_grad:
            text = f"{text[:-1]}, requires_grad=True)"
        if getattr(self, "_is_param", False):
            return f"Parameter containing:\n{text}"
        return text

    def __format__(self, format_spec):
        if self.dim() == 0:
            return self.item().__format__(format_spec)  # like torch.Tensor.__format__: a scalar read
        return object.__format__(self, format_spec)

    def tolist(self):
        _record("scalar_read")
        return self._cpu.tolist()

    def numpy(self, *, force: bool = False):
        if not force:
            raise TypeError(f"can't convert {_DEVICE_STR} device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        _record("d2h")
        return self._cpu.detach().resolve_conj().resolve_neg().clone().numpy()

    def data_ptr(self) -> int:
        return self._cpu.data_ptr()

    def untyped_storage(self):
        return self._cpu.untyped_storage()

    def __reduce_ex__(self, proto):
        # torch.save: the data goes through the CPU and comes back to the device on load, or stays on the CPU with
        # map_location="cpu" (the rebuild functions honour map_location and are on torch.load's weights_only list).
        if getattr(self, "_is_param", False):  # a Parameter (nn.Parameter(wrapper) marks it so): stay one
            return (torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, OrderedDict()))
        return (torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (self.detach().cpu(), self.dtype, _DEVICE_STR, self.requires_grad))

    def __deepcopy__(self, memo):
        if not self.is_leaf:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment.")
        if id(self) in memo:
            return memo[id(self)]
        # memo is shared with the CPU tensors' deepcopy, so views of one storage stay views of one copy.
        new = _wrap(copy.deepcopy(self._cpu, memo))
        memo[id(self)] = new
        new.requires_grad_(self.requires_grad)
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for key, value in self.__dict__.items():
            if key != "_cpu":
                setattr(new, key, copy.deepcopy(value, memo))
        return new


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a tensor on the fake device."""
    return type(tensor) is FakeDeviceTensor


# ---------------------------------------------------------------------------------------------------------------
# Op policies: how each ATen op is checked, run and wrapped (computed once per op overload)
# ---------------------------------------------------------------------------------------------------------------

class _Policy:
    """Per-op facts the dispatcher needs, computed by :func:`_policy`."""

    __slots__ = ("handler", "name", "check", "max_cpu_scalars", "arg_names", "checked_names", "written_names",
                 "write_returns", "view_returns", "mutable", "resync", "generator", "random_swap", "sync")


_POLICIES: dict[Any, _Policy] = {}
_NO_CHECK: set[str] | None = None

# Output size depends on device data: CUDA copies a count to the host first.
_SYNC_OPS = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
             "unique_dim_consecutive", "bincount", "equal", "nonzero_numpy"}
_RESIZING_INPLACE = {"resize_", "resize_as_", "set_", "_resize_output_", "resize_as_sparse_", "sparse_resize_",
                     "sparse_resize_and_clear_", "_copy_from_and_resize"}


def _no_check_ops() -> set[str]:
    """Names ``op.overload`` of the ops whose native_functions.yaml entry says ``device_check: NoCheck``."""
    global _NO_CHECK
    if _NO_CHECK is None:
        names: set[str] = set()
        try:
            import torchgen
            path = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "ATen", "native",
                                "native_functions.yaml")
            current = None
            with open(path, encoding="utf-8") as f:
                for line in f:
                    match = re.match(r"- func: ([\w.]+)\(", line)
                    if match:
                        current = match.group(1)
                    elif current and line.strip().startswith("device_check: NoCheck"):
                        names.add(current)
        except (ImportError, OSError):  # no torchgen: treat pointwise ops as TensorIterator ops (see _policy)
            warnings.warn("fake_accelerator: torchgen's native_functions.yaml not found; device rules fall back "
                          "to op tags", stacklevel=3)
        _NO_CHECK = names
    return _NO_CHECK


def _policy(func) -> _Policy:
    """Work out, once per op overload, how ``__torch_dispatch__`` treats it (from its schema, tags and yaml entry)."""
    schema = func._schema
    op_name = schema.name.split("::", 1)[-1]
    full_name = op_name + (f".{schema.overload_name}" if schema.overload_name else "")
    p = _Policy()
    p.name = full_name
    arguments = schema.arguments
    p.arg_names = [a.name for a in arguments]
    p.checked_names = {a.name for a in arguments if not a.kwarg_only or a.is_out}
    # Outputs for TensorIterator's rule: out= arguments and the self of an in-place op (never CPU scalars).
    p.written_names = {a.name for a in arguments if a.is_out or (a.alias_info is not None and a.alias_info.is_write)}
    no_check = _no_check_ops()
    if no_check:
        loose = full_name in no_check
    else:
        loose = torch.Tag.pointwise in func.tags
    p.check = "iter" if loose else "strict"
    p.max_cpu_scalars = 1_000_000 if (op_name.startswith("_foreach_") or op_name == "where") else 1

    # Returns that alias a written argument (in-place / out=): return that argument object itself.
    write_returns = []
    any_write = False
    for ret in schema.returns:
        target = None
        if ret.alias_info is not None and ret.alias_info.is_write:
            for i, arg in enumerate(arguments):
                if arg.alias_info is not None and arg.alias_info.is_write and \
                        arg.alias_info.before_set == ret.alias_info.before_set:
                    target = (i, arg.name)
                    any_write = True
                    break
        write_returns.append(target)
    p.write_returns = write_returns if any_write else None
    p.view_returns = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
    p.mutable = [(i, a.name) for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write]
    p.resync = bool(p.mutable) and (any(a.is_out for a in arguments) or torch.Tag.inplace_view in func.tags
                                    or op_name in _RESIZING_INPLACE)
    p.generator = next(((i, a.name) for i, a in enumerate(arguments) if "Generator" in str(a.type)), None)
    p.random_swap = p.generator is None and torch.Tag.nondeterministic_seeded in func.tags
    p.sync = op_name in _SYNC_OPS or (op_name == "repeat_interleave" and schema.overload_name.startswith("Tensor"))

    special = _SPECIAL.get(op_name)
    p.handler = special if special is not None else _generic
    _POLICIES[func] = p
    return p


# -- argument unwrapping and checks -----------------------------------------------------------------------------

def _unwrap(value, name, seen):
    if isinstance(value, torch.Tensor):
        seen.append((name, value))
        if type(value) is FakeDeviceTensor:
            return value._cpu
        return value
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_unwrap(v, name, seen) for v in value)
    return value


def _unwrap_all(p: _Policy, args, kwargs):
    seen: list[tuple[str, torch.Tensor]] = []
    names = p.arg_names
    n = len(names)
    cargs = [_unwrap(a, names[i] if i < n else "?", seen) for i, a in enumerate(args)]
    ckwargs = {k: _unwrap(v, k, seen) for k, v in kwargs.items()}
    return cargs, ckwargs, seen


def _check_devices(p: _Policy, seen) -> None:
    """Raise as CUDA would for a mix of device and CPU tensors (see the module docstring)."""
    if all(type(t) is FakeDeviceTensor for _, t in seen):
        return
    if p.check == "strict":
        common = None
        for name, t in seen:
            if name not in p.checked_names:
                continue  # CUDA's generated check covers positional and out= arguments only
            dev = _DEVICE_STR if type(t) is FakeDeviceTensor else str(t.device)
            if common is None:
                common = dev
            elif dev != common:
                raise RuntimeError(f"Expected all tensors to be on the same device, but got {name} is on {dev}, "
                                   f"different from other tensors on {common} (when checking argument in method "
                                   f"wrapper_{DEVICE_TYPE}_{p.name.replace('.', '_')})")
        return
    # TensorIterator: the common device is the first non-CPU one; CPU 0-dim inputs ride along as scalars.
    scalars = 0
    for name, t in seen:
        if type(t) is FakeDeviceTensor:
            continue
        if t.dim() == 0 and t.device.type == "cpu" and name not in p.written_names:
            scalars += 1
            if scalars > p.max_cpu_scalars:
                raise RuntimeError("Trying to pass too many CPU scalars to non-CPU kernel!")
            _check_scalar_grad(t)
            continue
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{_DEVICE_STR} and {t.device}!")


def _check_scalar_grad(t: torch.Tensor) -> None:
    if t.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            f"fake accelerator: a CPU 0-dim tensor that requires grad is used in a {DEVICE_TYPE} op. CUDA allows "
            "it (its gradient is moved back to the CPU), but autograd cannot do that for the fake device's "
            "wrapper tensors; put the tensor on the device (or detach it) in this test.")


def _output_on_device(kwargs) -> bool:
    device = kwargs.get("device")
    return device is None or torch.device(device).type == DEVICE_TYPE


def _wrap_result(out):
    if isinstance(out, torch.Tensor):
        return _wrap(out) if type(out) is not FakeDeviceTensor else out
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_result(o) for o in out)
    return out


def _arg(args, kwargs, index: int, name: str, default=None):
    if index < len(args):
        return args[index]
    return kwargs.get(name, default)


# -- random numbers -----------------------------------------------------------------------------------------------

# A FakeDeviceGenerator is a CPU generator underneath, and __torch_dispatch__ receives a new Python object for it
# (the subclass instance is not preserved), so device generators are recognised by their seed: the top 24 bits
# are _DEVICE_SEED_TAG. CPU generators seeded with anything below 2**40 never carry it (a random 64-bit seed does
# with probability 2**-24). The low 40 bits are the user's seed scrambled, so a device stream differs from the
# CPU stream of the same seed, as a CUDA generator's does.
_DEVICE_SEED_TAG = 0xFA4E6B
_LOW_BITS = (1 << 40) - 1


def _device_seed(seed: int) -> int:
    scrambled = ((int(seed) % (1 << 64)) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % (1 << 64)
    return (_DEVICE_SEED_TAG << 40) | (scrambled & _LOW_BITS)


def _is_device_generator(generator: torch.Generator) -> bool:
    return generator.device.type == "cpu" and generator.initial_seed() >> 40 == _DEVICE_SEED_TAG


class FakeDeviceGenerator(torch.Generator):
    """A random generator "on" ``fakegpu:0``: device ops accept it, and ``.device`` reads ``fakegpu:0``.

    It draws with the CPU's Mersenne Twister from a tagged, scrambled seed (see :func:`fake_generator`): its
    numbers differ from a CPU generator's with the same seed, as a CUDA generator's do. ``initial_seed()`` returns
    the seed given to ``manual_seed``.
    """

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return install()

    def manual_seed(self, seed):  # type: ignore[override]
        self._user_seed = int(seed)
        super().manual_seed(_device_seed(seed))
        return self

    def seed(self) -> int:  # type: ignore[override]
        value = int.from_bytes(os.urandom(8), "little")
        self.manual_seed(value)
        return value

    def initial_seed(self) -> int:  # type: ignore[override]
        return getattr(self, "_user_seed", super().initial_seed())


def fake_generator(seed: int | None = None) -> FakeDeviceGenerator:
    """A generator that device ops accept (``torch.Generator(device="fakegpu")`` cannot be created).

    Args:
        seed: ``manual_seed`` it with this; None seeds it non-deterministically.

    Only the seed marks it as a device generator: ``set_state`` with a CPU generator's state, or a C++-level
    ``manual_seed``, turns it back into a CPU generator as far as device ops are concerned.
    """
    generator = FakeDeviceGenerator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


_device_generator = fake_generator(torch.initial_seed())


def _checked_generator(generator):
    """The generator a device op may use: None -> the device's default; a CPU generator raises (as on CUDA)."""
    if generator is None:
        return _device_generator
    if _is_device_generator(generator):
        return generator
    raise RuntimeError(f"Expected a '{DEVICE_TYPE}' device type for generator but found '{generator.device.type}'")


@contextlib.contextmanager
def _device_rng_as_cpu_default() -> Iterator[None]:
    # For random ops without a generator argument (native_dropout ...): their CPU kernel draws from the CPU
    # default generator, so lend it the device generator's state for the call.
    cpu = torch.default_generator
    saved = cpu.get_state()
    cpu.set_state(_device_generator.get_state())
    try:
        yield
    finally:
        _device_generator.set_state(cpu.get_state())
        cpu.set_state(saved)


# -- handlers -----------------------------------------------------------------------------------------------------

def _generic(func, p: _Policy, args, kwargs):
    """Check devices, run the CPU kernel on the unwrapped arguments, hand back wrappers (or the written arguments)."""
    cargs, ckwargs, seen = _unwrap_all(p, args, kwargs)
    _check_devices(p, seen)
    on_device = True
    if "device" in ckwargs:
        on_device = _output_on_device(ckwargs)
        if on_device:
            ckwargs["device"] = torch.device("cpu")
    if p.generator is not None and on_device:
        index, name = p.generator
        if index < len(cargs):
            cargs[index] = _checked_generator(cargs[index])
        else:
            ckwargs[name] = _checked_generator(ckwargs.get(name))
    if p.sync:
        _record("sync")
    if p.random_swap and on_device:
        with _device_rng_as_cpu_default():
            out = func(*cargs, **ckwargs)
    else:
        out = func(*cargs, **ckwargs)
    if p.resync:
        for index, name in p.mutable:
            target = _arg(args, kwargs, index, name)
            if type(target) is FakeDeviceTensor:
                _resync(target)
    if p.write_returns is not None:
        return _aliased_result(p, args, kwargs, out)
    if not on_device:
        return out
    if p.view_returns and cargs and isinstance(out, torch.Tensor) and out is cargs[0]:
        out = out.detach()  # a fresh CPU tensor object: two wrappers must not share one (see _resync)
    return _wrap_result(out)


def _aliased_result(p: _Policy, args, kwargs, out):
    """Results of an in-place/out= op: the written argument objects themselves, fresh wrappers for the rest."""
    targets = p.write_returns
    if len(targets) == 1:
        index, name = targets[0]
        return _arg(args, kwargs, index, name)
    results = []
    for target, value in zip(targets, out):
        results.append(_arg(args, kwargs, *target) if target is not None else _wrap_result(value))
    return tuple(results)


def _to_copy(func, p: _Policy, args, kwargs):
    src = args[0]
    ckwargs = dict(kwargs)
    if "device" in ckwargs and not _output_on_device(ckwargs):
        _record("d2h")
        return func(src._cpu, *args[1:], **ckwargs)
    ckwargs.pop("device", None)
    return _wrap(func(src._cpu, *args[1:], **ckwargs))


def _copy_(func, p: _Policy, args, kwargs):
    dst, src = args[0], args[1]
    rest = args[2:]
    dst_fake, src_fake = type(dst) is FakeDeviceTensor, type(src) is FakeDeviceTensor
    if dst_fake and not src_fake:
        _record("h2d")
        func(dst._cpu, src, *rest, **kwargs)
    elif src_fake and not dst_fake:
        _record("d2h")
        func(dst, src._cpu, *rest, **kwargs)
    else:
        func(dst._cpu, src._cpu, *rest, **kwargs)
    return dst


def _local_scalar_dense(func, p: _Policy, args, kwargs):
    _record("scalar_read")
    return func(args[0]._cpu)


def _is_mask(t: torch.Tensor) -> bool:
    return t.dtype in (torch.bool, torch.uint8)


def _index(func, p: _Policy, args, kwargs):
    self = args[0]
    indices = _arg(args, kwargs, 1, "indices")
    if type(self) is not FakeDeviceTensor:
        if any(type(i) is FakeDeviceTensor for i in indices if i is not None):
            raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed tensor "
                               f"({self.device})")
    else:
        for i in indices:
            if i is None:
                continue
            if type(i) is not FakeDeviceTensor:
                _record("h2d")  # ATen's make_info copies CPU indices to the device
            elif _is_mask(i):
                _record("sync")  # nonzero() of a device mask: the result size comes back to the host
    cargs, ckwargs, _ = _unwrap_all(p, args, kwargs)
    return _wrap_result(func(*cargs, **ckwargs)) if type(self) is FakeDeviceTensor else func(*cargs, **ckwargs)


def _index_put(func, p: _Policy, args, kwargs):
    self = args[0]
    indices = _arg(args, kwargs, 1, "indices")
    value = _arg(args, kwargs, 2, "values")
    accumulate = _arg(args, kwargs, 3, "accumulate", False)
    self_fake = type(self) is FakeDeviceTensor
    value_fake = type(value) is FakeDeviceTensor
    defined = [i for i in indices if i is not None]
    # ATen's canDispatchToMaskedFill: one bool mask on self's device and a one-element CPU value -> masked_fill_
    # with value.item() (a CPU read), no index tensors at all.
    masked_fill = (not accumulate and not value_fake and value.numel() == 1 and len(defined) == 1
                   and _is_mask(defined[0]) and (type(defined[0]) is FakeDeviceTensor) == self_fake)
    if value_fake != self_fake:
        if value.dim() == 0:
            if not masked_fill:
                _record("h2d" if self_fake else "d2h")  # value.to(self.device())
            if not value_fake:
                _check_scalar_grad(value)
        elif self_fake and accumulate:
            raise RuntimeError(f"expected device {_DEVICE_STR} but got device {value.device} for value tensor")
        else:
            other = value.device if self_fake else self.device
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{_DEVICE_STR} and {other}!")
    if not masked_fill:
        for i in defined:
            i_fake = type(i) is FakeDeviceTensor
            if i_fake and _is_mask(i):
                _record("sync")  # nonzero() of a device mask
            if i_fake != self_fake:
                _record("h2d" if self_fake else "d2h")  # indices follow self (make_info)
    cargs, ckwargs, _ = _unwrap_all(p, args, kwargs)
    out = func(*cargs, **ckwargs)
    if p.write_returns is not None:
        return _aliased_result(p, args, kwargs, out)
    return _wrap_result(out) if self_fake else out


def _masked_fill(func, p: _Policy, args, kwargs):
    self, mask = args[0], _arg(args, kwargs, 1, "mask")
    value = _arg(args, kwargs, 2, "value")
    self_fake = type(self) is FakeDeviceTensor
    if isinstance(value, torch.Tensor) and value.dim() == 0:  # the CPU kernel reports a wrong dim itself
        if type(value) is FakeDeviceTensor:
            if not self_fake:
                raise RuntimeError("masked_fill_: Expected inputs to be on same device")
            _record("scalar_read")  # CUDA's masked_fill_ reads value.item()
        else:
            _check_scalar_grad(value)
    if self_fake != (type(mask) is FakeDeviceTensor):
        raise RuntimeError(f"expected self and mask to be on the same device, but got mask on {mask.device} and "
                           f"self on {self.device}")
    cargs, ckwargs, _ = _unwrap_all(p, args, kwargs)
    out = func(*cargs, **ckwargs)
    if p.write_returns is not None:
        return _aliased_result(p, args, kwargs, out)
    return _wrap_result(out)


_SPECIAL = {
    "_to_copy": _to_copy,
    "copy_": _copy_,
    "_local_scalar_dense": _local_scalar_dense,
    "index": _index,
    "_unsafe_index": _index,
    "index_put_": _index_put,
    "index_put": _index_put,
    "_index_put_impl_": _index_put,
    "_unsafe_index_put": _index_put,
    "masked_fill_": _masked_fill,
    "masked_fill": _masked_fill,
}


# ---------------------------------------------------------------------------------------------------------------
# PrivateUse1 kernels (factories with no tensor argument) and the backend module (torch.fakegpu)
# ---------------------------------------------------------------------------------------------------------------

def _empty_memory_format(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _wrap(torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _wrap(torch.empty_strided(size, stride, dtype=dtype, layout=layout))


def _copy_from(self, dst, non_blocking=False):
    # copy_ with the Python key excluded (torch.tensor(data, device=...), x[[0, 2]]: torch builds the tensor on the
    # CPU, then copies it under an ExcludeDispatchKeyGuard(Python)), so copy_ lands on PrivateUse1's _copy_from.
    src_fake, dst_fake = type(self) is FakeDeviceTensor, type(dst) is FakeDeviceTensor
    src = self._cpu if src_fake else self
    if dst_fake:
        if not src_fake:
            _record("h2d")
        dst._cpu.copy_(src, non_blocking)
    else:
        if src_fake:
            _record("d2h")
        dst.copy_(src, non_blocking)
    return dst


def _local_scalar_dense_kernel(self):
    # A scalar read with the Python key excluded: torch.tensor([device_scalar, ...]) reads each element this way
    # (transformers' Qwen2-VL rope index does); the boxed fallback cannot take it, so it has its own kernel.
    _record("scalar_read")
    return self._cpu.item() if type(self) is FakeDeviceTensor else self.item()


def _copy_from_and_resize(self, dst):
    src_fake = type(self) is FakeDeviceTensor
    src = self._cpu if src_fake else self
    if type(dst) is FakeDeviceTensor:
        if not src_fake:
            _record("h2d")
        dst._cpu.resize_(src.shape).copy_(src)
        _resync(dst)
    else:
        if src_fake:
            _record("d2h")
        dst.resize_(src.shape).copy_(src)
    return dst


def _fallback(op, *args, **kwargs):
    # Any other op that reaches the PrivateUse1 key: a factory asked for device="fakegpu" with no tensor argument
    # (tril_indices, ...). Run it on the CPU and move the result.
    p = _POLICIES.get(op) or _policy(op)
    cargs, ckwargs, _ = _unwrap_all(p, args, kwargs)
    if "device" in ckwargs and _output_on_device(ckwargs):
        ckwargs["device"] = torch.device("cpu")
    if p.generator is not None:
        index, name = p.generator
        if index < len(cargs):
            cargs[index] = _checked_generator(cargs[index])
        else:
            ckwargs[name] = _checked_generator(ckwargs.get(name))
    return _wrap_result(op(*cargs, **ckwargs))


# -- autocast: CUDA's op lists (torch/csrc/autocast_mode.cpp), so a bfloat16 autocast region changes dtypes the way
# it would on the GPU. Only the listed ops get a (Python) kernel; every other op falls through the key.

_AUTOCAST_LOWER = ("_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
                   "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
                   "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
                   "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
                   "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
_AUTOCAST_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
                  "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm",
                  "frobenius_norm", "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss",
                  "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
                  "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
                  "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
                  "cdist", "renorm", "logsumexp", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                  "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
                  "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
                  "upsample_bicubic2d", "_upsample_bicubic2d_aa")
_AUTOCAST_FP32_SET_OPT_DTYPE = ("prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
                                "linalg_matrix_norm", "sum")
_AUTOCAST_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                     "scatter_add", "tensordot")
_LOWER_DTYPES = (torch.float16, torch.bfloat16)


def _autocast_eligible(value) -> bool:
    return type(value) is FakeDeviceTensor and value.is_floating_point() and value.dtype != torch.float64


def _autocast_cast(value, dtype):
    if _autocast_eligible(value):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_autocast_cast(v, dtype) for v in value)
    return value


def _autocast_tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from (v for v in value if _autocast_eligible(v))
        elif _autocast_eligible(value):
            yield value


def _autocast_kernel(op, policy: str):
    dtype_index = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
    exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def kernel(*args, **kwargs):
        if policy == "lower":
            target = torch.get_autocast_dtype(DEVICE_TYPE)
        elif policy == "fp32":
            target = torch.float32
        elif policy == "promote":
            dtypes = [t.dtype for t in _autocast_tensors(args, kwargs)]
            target = max(dtypes, key=lambda d: torch.finfo(d).bits) if dtypes else None
        else:  # fp32_set_opt_dtype: reduce in float32 unless the caller chose a dtype
            target = None
            given = args[dtype_index] if dtype_index is not None and dtype_index < len(args) else kwargs.get("dtype")
            if given is None and dtype_index is not None and \
                    any(t.dtype in _LOWER_DTYPES for t in _autocast_tensors(args, kwargs)):
                kwargs = {**kwargs, "dtype": torch.float32}
        with torch._C._ExcludeDispatchKeyGuard(exclude):
            if target is not None:
                args = [_autocast_cast(a, target) for a in args]
                kwargs = {k: _autocast_cast(v, target) for k, v in kwargs.items()}
            return op(*args, **kwargs)
    return kernel


def _autocast_banned(*args, **kwargs):
    raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast. Use "
                       "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss instead.")


def _register_autocast(lib: torch.library.Library) -> None:
    policies = [(n, "lower") for n in _AUTOCAST_LOWER] + [(n, "fp32") for n in _AUTOCAST_FP32] + \
               [(n, "fp32_set_opt_dtype") for n in _AUTOCAST_FP32_SET_OPT_DTYPE] + \
               [(n, "promote") for n in _AUTOCAST_PROMOTE]
    for name, policy in policies:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if any(a.is_out for a in op._schema.arguments):
                continue  # autocast leaves out= variants alone
            lib.impl(op._schema.name.split("::")[-1] + ("." + overload if overload != "default" else ""),
                     _autocast_kernel(op, policy))
    for overload in torch.ops.aten.binary_cross_entropy.overloads():
        if overload == "default":
            lib.impl("binary_cross_entropy", _autocast_banned)


class _BackendModule:
    """``torch.fakegpu``: what torch asks of a device module (availability, RNG, autocast dtypes)."""

    def is_available(self) -> bool:
        # False on purpose: torch.accelerator.is_available() delegates here, and libraries that pick the
        # accelerator by themselves (accelerate's default device, diffusers' get_device, DataLoader's
        # pin_memory) must keep using the CPU in the rest of the test process. Tests ask for DEVICE explicitly.
        return False

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device) -> None:
        pass

    def synchronize(self, device=None) -> None:
        _record("sync")

    def manual_seed(self, seed: int) -> None:
        _device_generator.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:  # torch.manual_seed / torch.seed call this
        _device_generator.manual_seed(seed)

    def seed(self) -> None:
        _device_generator.seed()

    def seed_all(self) -> None:
        _device_generator.seed()

    def initial_seed(self) -> int:
        return _device_generator.initial_seed()

    def get_rng_state(self, device=None) -> torch.Tensor:
        return _device_generator.get_state()

    def set_rng_state(self, new_state: torch.Tensor, device=None) -> None:
        _device_generator.set_state(new_state)

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return True

    def empty_cache(self) -> None:
        pass

    default_generator = property(lambda self: _device_generator)


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed


def install(*, allow_with_cuda: bool = False) -> torch.device:
    """Register the ``fakegpu`` device: once per process, later calls return at once (thread-safe).

    Tolerates a PrivateUse1 backend already renamed ``fakegpu`` (by hand, or a half-finished earlier attempt).
    See the module docstring for what installing changes process-wide.

    Args:
        allow_with_cuda: install even though CUDA is available. Registering a PrivateUse1 backend makes it
            torch's accelerator for the rest of the process, which breaks backward passes over real CUDA tensors.

    Returns:
        :data:`DEVICE` (``torch.device("fakegpu", 0)``).

    Raises:
        RuntimeError: CUDA is available (and ``allow_with_cuda`` is false); PrivateUse1 is another backend; or
            another copy of this module (imported under another name) registered the kernels already.
    """
    global _installed, _DEVICE
    with _install_lock:
        if _installed:
            return _DEVICE
        if torch.cuda.is_available() and not allow_with_cuda:
            raise RuntimeError("fake_accelerator.install(): CUDA is available in this process; a PrivateUse1 "
                               "backend would become torch's accelerator and break CUDA backward passes "
                               "(pytorch#161129). Use the real GPU, or pass allow_with_cuda=True.")
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", DEVICE_TYPE):
            raise RuntimeError(f"fake_accelerator.install(): PrivateUse1 is already the {name!r} backend")
        if torch._C._dispatch_has_kernel_for_dispatch_key("aten::empty.memory_format", "PrivateUse1"):
            raise RuntimeError(f"fake_accelerator.install(): the {DEVICE_TYPE!r} backend already has kernels, "
                               "registered by another copy of this module (imported under another name?)")
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
        if name == "privateuseone":
            # Can run only once per process (the rename is permanent).
            _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=_BackendModule())
        elif not hasattr(torch, DEVICE_TYPE):  # renamed to our name by hand, without a device module
            torch.utils.generate_methods_for_privateuse1_backend()
            torch._register_device_module(DEVICE_TYPE, _BackendModule())
        # (Renamed to our name and set up by someone else: their device module stays; our kernels go on.)
        lib = torch.library.Library("aten", "IMPL", "PrivateUse1")
        lib.impl("empty.memory_format", _empty_memory_format)
        lib.impl("empty_strided", _empty_strided)
        lib.impl("_copy_from", _copy_from)
        lib.impl("_copy_from_and_resize", _copy_from_and_resize)
        lib.impl("_local_scalar_dense", _local_scalar_dense_kernel)
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(_fallback, "PrivateUse1")
        # Autocast on the device: CUDA's op lists; all other ops pass through the key untouched.
        fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
        autocast = torch.library.Library("aten", "IMPL", "AutocastPrivateUse1")
        _register_autocast(autocast)
        _libraries.extend([lib, fallback, autocast])
        _device_generator.manual_seed(torch.initial_seed())
        _DEVICE = torch.device(DEVICE_TYPE, 0)
        _installed = True
        return _DEVICE


# ---------------------------------------------------------------------------------------------------------------
# Moving things
# ---------------------------------------------------------------------------------------------------------------

def to_device(obj):
    """``obj`` on the fake device: a tensor (``.to(DEVICE)``), a module (moved in place, Parameters keep their
    identity; returned), or a dict/list/tuple of those (a new container). Installs the device if needed."""
    device = install()
    if isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v) for v in obj)
    return obj


def to_cpu(obj):
    """``obj`` back on the CPU; a module keeps its Parameter objects (``module.to("cpu")`` would replace them)."""
    if isinstance(obj, torch.nn.Module):
        previous = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            return obj.to("cpu")
        finally:
            torch.__future__.set_swap_module_params_on_conversion(previous)
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return type(obj)((k, to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


@contextlib.contextmanager
def on_device(*modules: torch.nn.Module) -> Iterator[torch.device]:
    """Run the ``with`` block with ``modules`` on the fake device, and put them back on the CPU afterwards
    (same Parameter objects throughout). Yields :data:`DEVICE`."""
    device = install()
    for module in modules:
        module.to(device)
    try:
        yield device
    finally:
        for module in modules:
            to_cpu(module)


def __getattr__(name: str):
    # PEP 562: ``DEVICE`` exists once the backend does; reading it installs the backend.
    if name == "DEVICE":
        return install()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
