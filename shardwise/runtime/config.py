"""DeepSpeed's `deepspeed.runtime.config` optimizer-name constants: the lower-case "type" values of an `"optimizer"`
section (the config accepts them in any case) and Adam's extra parameter names. DeepSpeed's `DeepSpeedConfig`
class has no counterpart here: shardwise's parsed config is `shardwise.config.EngineConfig` (`engine.config`)."""

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, MUADAM_OPTIMIZER,
                        MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER]

TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "ADAM_W_MODE", "ADAM_W_MODE_DEFAULT",
           "DEEPSPEED_OPTIMIZERS", "LAMB_OPTIMIZER", "LION_OPTIMIZER", "MUADAMW_OPTIMIZER", "MUADAM_OPTIMIZER",
           "MUON_OPTIMIZER", "MUSGD_OPTIMIZER", "TORCH_ADAM_PARAM"]
