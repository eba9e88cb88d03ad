"""tandem's control plane: the ``tandem`` command line and cluster management."""
