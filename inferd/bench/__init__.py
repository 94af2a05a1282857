"""Benchmarks: inferd over HTTP and peers in-process, the same workloads side by side."""
