"""The RL algorithm, apart from the actors that distribute it: advantages and the policy
loss (`grpo`), the torch step (`trainer`), atomic checkpoints with the consumed-rollout
ledger (`checkpoint`), the curriculum's rules (`curriculum`), held-out sets and the
contamination check (`evalsets`), pass@k and paired changes (`scoring`), the one prompt
format (`prompts`) and SFT (`sft`).

Nothing here imports trio, NATS or an actor: each piece is a function of its inputs, so it
is tested on hand-made data and read without the messaging around it.
"""
