"""The one layer every checkpoint and model file passes through, read or written.

Each rule has one home (``docs/DEVELOPING.md``, Layout): ``paths`` (a name stays inside its folder,
opened without following links, a plain file), ``durable`` (fsync, temp file then rename),
``checksum`` (bsum64), ``safetensors_format`` (the header parser and the writer), ``reading`` (the
bytes verified are the bytes loaded: one read into private memory), ``errors`` (the exceptions).
Importing this package imports nothing.
"""
