"""reinforge.kernels — see ARCHITECTURE.md."""
