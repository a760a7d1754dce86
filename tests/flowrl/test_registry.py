import pytest

from flowrl.registry import Registry, UnknownNameError


def test_register_get_and_lazy_entries():
    reg = Registry("widget")

    @reg.register("alpha")
    def alpha():
        return 1

    reg.register("json_dumps", "json:dumps")
    assert reg.get("alpha") is alpha
    assert reg.get("json_dumps")({"a": 1}) == '{"a": 1}'
    assert reg.names() == ["alpha", "json_dumps"] and "alpha" in reg


def test_unknown_name_lists_valid_names_and_suggests():
    reg = Registry("step function")
    for name in ("flow_sde", "dance_sde", "cps"):
        reg.register(name, object())
    with pytest.raises(UnknownNameError) as info:
        reg.get("flow_sd")
    assert str(info.value) == ("unknown step function 'flow_sd' (did you mean 'flow_sde'?); "
                               "valid names: cps, dance_sde, flow_sde")


def test_duplicate_registration_is_an_error():
    reg = Registry("loss")
    reg.register("a", object())
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", object())
