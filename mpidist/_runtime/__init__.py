"""The runtime: init_process_group and destroy, the world state, backend queries, the watchdog."""
