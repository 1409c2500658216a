# Run from the repository's root: torchrun --nproc_per_node=2 examples/first_training.py
import torch
from transformers import GPT2Config, PreTrainedTokenizerFast

import oslo

tokenizer = PreTrainedTokenizerFast.from_pretrained("assets/tokenizer")
config = GPT2Config.from_json_file("assets/demo_config.json")  # a small GPT2 (4 blocks, 128 wide)
model = oslo.GPT2LMHeadModel.from_config_with_parallel(config, tensor_parallel_size=2, seed=0)

ids = tokenizer(open("assets/corpus.txt").read(), return_tensors="pt", verbose=False).input_ids[0]
samples = ids[: len(ids) // 128 * 128].view(-1, 128)  # Persuasion, in 128-token samples
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
generator = torch.Generator().manual_seed(0)  # both ranks must draw the same batches
for step in range(60):
    batch = samples[torch.randint(len(samples), (8,), generator=generator)]
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 10 == 0 and model.parallel_context.rank == 0:
        print(f"step {step}: loss {loss.item():.2f}")

model.save_pretrained_with_parallel("my_first_model", save_with_merging=True)  # plain transformers files
