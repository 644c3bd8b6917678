"""The training functions of example_dags/torch_elastic_frameworks.py: Hugging Face ``transformers``, Lightning and
``accelerate``, each with the provider's integration (``airflow_provider_torchelastic.integrations``).

A module of its own, without a DAG: the workers may import it (it imports nothing at the top but typing), and
tests/dags/frameworks_e2e.py runs these same functions. Tiny models on synthetic data (no download); the lines between
``[START ...]`` and ``[END ...]`` are what docs/guides/integrations.md shows, and they are the same for a real model.
``interrupt=True`` makes a first try fail recoverably right after its first checkpoint, to show a retry resuming.
"""

from __future__ import annotations

from typing import Any


def train_transformers(steps: int = 6, save_steps: int = 2, interrupt: bool = False) -> dict[str, Any]:
    """A two-layer GPT-2 of 16 dimensions learns a repeating sequence with the Hugging Face Trainer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from airflow_provider_torchelastic import RecoverableError, context
    from airflow_provider_torchelastic.integrations import transformers as te_transformers

    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (64, 8), generator=generator) % 4]

    class InterruptAfterFirstSave(TrainerCallback):  # only to show a retry resuming
        first_step = 0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.first_step = state.global_step  # the steps a checkpoint gave this try

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if interrupt and context.current().try_number == 1:
                raise RecoverableError(f"interrupted after the checkpoint of step {state.global_step}")

    interrupter = InterruptAfterFirstSave()
    # [START transformers]
    args = TrainingArguments(
        output_dir=te_transformers.output_dir(),  # a local folder, kept in the checkpoint location
        max_steps=steps,
        save_steps=save_steps,
        save_total_limit=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        use_cpu=True,
        ddp_backend="gloo",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    torch.manual_seed(0)  # the Trainer's seed is set after the model exists: seed its initial weights here
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=[te_transformers.TorchElasticCallback(), interrupter],
    )
    te_transformers.train(trainer)  # in place of trainer.train(): resumes from the newest checkpoint
    # [END transformers]
    with torch.no_grad():  # the trained model's loss on all the data
        everything = torch.stack([example["input_ids"] for example in data])
        loss = model(input_ids=everything, labels=everything).loss.item()
    return {"steps": trainer.state.global_step, "first_step": interrupter.first_step, "loss": loss}


def train_lightning(steps: int = 8, save_every: int = 2, interrupt: bool = False) -> dict[str, Any]:
    """A linear regression with Lightning's DDP, sized by the job: one node or several, as the job started."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from airflow_provider_torchelastic import RecoverableError, context
    from airflow_provider_torchelastic.integrations import lightning as te_lightning

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
            self.first_step: int | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.first_step is None:
                self.first_step = self.trainer.global_step
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class InterruptAfterFirstCheckpoint(pl.Callback):  # only to show a retry resuming
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if interrupt and context.current().try_number == 1 and trainer.global_step == save_every:
                raise RecoverableError(f"interrupted after the checkpoint of step {save_every}")

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    # [START lightning]
    kwargs = te_lightning.trainer_kwargs(every_n_train_steps=save_every)  # num_nodes, devices, checkpoints, logger
    kwargs["callbacks"].append(InterruptAfterFirstCheckpoint())
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        strategy="ddp",
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    pl.seed_everything(0)  # before the model: every run (and the first try a retry resumes) starts from these weights
    model = Regression()
    trainer.fit(model, data, ckpt_path=te_lightning.ckpt_path())  # the last checkpoint of an earlier try, or None
    # [END lightning]
    return {
        "steps": trainer.global_step,
        "first_step": model.first_step,
        "loss": torch.nn.functional.mse_loss(model.layer(x), x.sum(dim=1, keepdim=True)).item(),  # on all the data
        "num_nodes": trainer.num_nodes,
        "devices": trainer.num_devices,
    }


def train_accelerate(steps: int = 8, save_every: int = 2, interrupt: bool = False) -> dict[str, Any]:
    """A linear regression in a loop of one's own, with ``accelerate``."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from airflow_provider_torchelastic import RecoverableError, context
    from airflow_provider_torchelastic.integrations import accelerate as te_accelerate

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    # [START accelerate]
    accelerator = Accelerator(cpu=True, log_with=te_accelerate.TorchElasticTracker())
    accelerator.init_trackers("train")  # accelerator.log reaches the trackers once they are started
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    checkpoints = te_accelerate.Checkpoints(accelerator)  # restores the local folder, wraps save_state
    first_step = checkpoints.resume()  # 0, or the step after the newest complete checkpoint
    batches = list(data)  # this rank's shard
    for step in range(first_step, steps):
        x_batch, y_batch = batches[step % len(batches)]
        loss = torch.nn.functional.mse_loss(model(x_batch), y_batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
        if step % save_every == save_every - 1:
            checkpoints.save(step)  # accelerator.save_state, then kept in the checkpoint location
            if interrupt and context.current().try_number == 1:
                raise RecoverableError(f"interrupted after the checkpoint of step {step}")
        checkpoints.stop_if_requested(step)  # a try being stopped saves, then raises StopRequested
    # [END accelerate]
    with torch.no_grad():  # the trained model's loss on all the data
        loss = torch.nn.functional.mse_loss(accelerator.unwrap_model(model)(x), x.sum(dim=1, keepdim=True))
    return {"steps": steps, "first_step": first_step, "loss": loss.item()}
