"""gradscale's reading side: run folders in, tables and figures out."""
