"""The optimizer on chunks: ``adamw`` (chunk-wise AdamW, loss scaling, clipping) and
``placement`` (how many chunks keep their optimizer states on the device)."""
