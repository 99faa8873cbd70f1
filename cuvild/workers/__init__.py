"""The device workers: the worker process, the daemon's handle on it, the part build, client
sessions and regions, and the pool that starts, watches and revives them."""
