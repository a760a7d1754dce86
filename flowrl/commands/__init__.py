"""Every ``flowrl`` command, one module each (the table is :data:`flowrl.cli.COMMANDS`): ``train``, ``sample`` and
``eval``, ``export``, ``data``, ``doctor``, the dry run; :mod:`flowrl.commands.args` holds their argument checks."""
