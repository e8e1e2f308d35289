"""Training: the train state and optimizer, the policy and critic, batches, objectives, the RL
trainer, SFT, checkpoints and metrics. Import the modules (`jaxrl_tools.train.rl`, ...)."""
