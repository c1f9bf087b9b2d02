"""Graph passes over the captured model and the pass manager that runs them (see DESIGN.md)."""
