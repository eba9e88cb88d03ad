"""The launch room: ``tandem serve`` and ``tandem gateway`` (``serve.py``), their flags
generated from the serve configuration (``serve_flags.py``, ``config_file.py``, the reference
table in ``config_reference.py``), secrets, detach, the local cluster (``local.py``: Ray,
redis-server, the controller actor, the workers) and the extra gateway processes
(``gateways.py``). Runs in the launcher process. Imports control (to start the controller),
never cli."""
