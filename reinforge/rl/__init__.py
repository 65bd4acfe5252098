"""The RL algorithm, apart from the actors that distribute it. Its centre is the reference
loop (`loop`): draw tasks, generate, verify, group advantages, one GRPO step, checkpoint,
load the weights -- the loop the actors cut at its arrows. Its pieces: advantages and the
policy loss (`grpo`), the conversions between the loop's messages and train samples
(`samples`), the torch step (`trainer`), atomic checkpoints with the consumed-rollout
ledger (`checkpoint`), the curriculum's rules (`curriculum`), held-out sets and the
contamination check (`evalsets`), pass@k and paired changes (`scoring`), the one prompt
format (`prompts`) and SFT (`sft`).

Nothing here imports trio, NATS or an actor: each piece is a function of its inputs, so it
is tested on hand-made data and read without the messaging around it.
"""
