"""Training P-EAGLE and EAGLE-3 drafter heads for any Hugging Face causal LM (docs/design.md, "Training objective").

data.py      conversations -> chat-template token ids + assistant loss mask; held-out benchmark guard
data_cmd.py  `peagle data prepare`
vocab.py     draft vocabulary (d2t / t2d)
cod.py       COD sampling, its attention mask, sequence partitioning, TTT element sets
teacher.py   the frozen target: features at the vLLM layer ids and the teacher distribution
head.py      the head a run starts from (draft vocab, mask token, initialisation)
objective.py the training forward (P-EAGLE COD / EAGLE-3 TTT) and its loss
trainer.py   the loop: AdamW, warmup+cosine, checkpoints and exact resume, eval, DDP under torchrun
train_cmd.py `peagle train`
"""

