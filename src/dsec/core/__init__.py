"""Pure logic shared by every component: ids, errors, lifecycle, specs. No I/O here."""
