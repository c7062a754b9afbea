"""EgoMem training (paper §4): corpus synthesis, audio, token streams, supervision masks, the masked
fine-tuning loop and the Table-3 evaluation. Read docs/training.md first.

Data flows one way: corpus (people, relation graphs, dialogs) -> streams (the 17-row token stream of
several dialogs, with their audio as Mimi codes) -> samples (a stream, the MemChunk texts in view and
what is supervised) -> finetune (masked loss over text and speak codebooks) -> eval-dialog.
"""
