"""io: checkpoint files, headers and sources; the only importer of the compiled extension."""
