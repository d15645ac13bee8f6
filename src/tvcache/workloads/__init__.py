"""Real post-training workloads for the demo and benchmarks: tasks, tools, rewards and a small policy."""
