"""reinforge.envs — see ARCHITECTURE.md."""
