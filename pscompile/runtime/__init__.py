"""What both modes share: ``engine`` (``ChunkEngine``: parameters into chunks, the one ``step()``
loop, the update, state dicts), ``params`` (the model's parameters, named and ordered, and their
layout), ``order`` (first-use order), ``batching`` (calling the model, micro-batches),
``materialize`` (meta-device models)."""
