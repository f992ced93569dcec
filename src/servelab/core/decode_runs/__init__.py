"""Multi-step decode runs: the lab's way to price many decode steps of a fixed batch at once.

Only the simulator takes them (EngineCore(decode_runs=True) on a VirtualClock); the real engine never imports this
package, which tests/core/test_decode_runs_isolated.py checks in a fresh process.
"""
