"""Buckets: plain ``sess.run()`` of dynamic-dim requests served from captured graphs, one per bucket (issue 16)."""
