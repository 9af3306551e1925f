"""`kvgate bench replay`: an HTTP run's routing decisions against the simulator's, one by one."""
