"""The capture core: per-session capture state, the ``gpu_graph_id`` registry, the capturing run, the one ORT run call, reference runs."""
