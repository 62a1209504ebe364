"""The local ROUGE module; `evaluate.load` reads rouge.py from this directory."""
