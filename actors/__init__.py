"""reinforge.actors — see ARCHITECTURE.md."""
