"""The engine-core process: its loop, the typed zmq protocol, process start-up and the disaggregated launcher."""
