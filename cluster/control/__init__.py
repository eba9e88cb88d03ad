"""The control room: the controller (``controller.py``, a named, detached Ray actor composed of
one component per concern: the membership table and health checks (``membership.py``),
spawning workers (``spawn.py``, from ``spec.py``'s ``WorkerSpec``), scaling, drain and role
switching (``scaling.py``), the autoscaler's loop (``autoscaling.py``; ``autoscaler.py``
decides), migration orchestration and rebalance (``migrations.py``, ``operations.py``) and
the event log (``events.py``)), the gRPC operator service it serves (``operator.py``) and the
flex worker it spawns (``flex_worker.py``). Runs in the controller actor's process. Imports
neither launch nor cli."""
