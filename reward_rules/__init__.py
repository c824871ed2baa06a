"""Rule rewards as data: verl's ported quirk for quirk, and this library's own; routing.py routes each row to its rule
by data_source, as verl's default_compute_score does."""
