"""Progress bars, run metadata and plots for the simulator and the benchmarks."""
