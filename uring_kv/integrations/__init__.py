"""Adapters that plug uring_kv into serving frameworks. Each module imports its framework, and is
imported only by that framework's configuration (``import uring_kv`` imports none of them)."""
