"""The control room: the controller (``controller.py``, a named, detached Ray actor that owns
membership and health, scaling and drain, rebalance and migration orchestration
(``migrations.py``, ``operations.py``), the autoscaler (``autoscaler.py``) and the event log),
the gRPC operator service it serves (``operator.py``) and the flex worker it spawns
(``flex_worker.py``). Runs in the controller actor's process. Imports neither launch nor cli."""
