"""tandem's control plane in three rooms, one per kind of process, importing one way::

    cli/      the ``tandem`` commands and the operator client        (the user's shell)
    launch/   ``tandem serve``: config, flags, the local cluster      (the launcher)
    control/  the controller actor, autoscaler, operator service       (the controller actor)

cli imports launch, launch imports control; control imports neither (import-linter contract in
pyproject.toml)."""
