"""The core layer: data -> masked tokens, packing, collate, packed forward + varlen attention, chunked loss,
distributed helpers, checkpoint I/O, export, paths, config and errors. Imports nothing above it."""
