"""reinforge.engine — see ARCHITECTURE.md."""
