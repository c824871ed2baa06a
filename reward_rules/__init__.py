"""Rule rewards as data: verl's ported quirk for quirk, and this library's own. rewards.py routes rows to them."""
