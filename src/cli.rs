//! The command line. Flags that overlap a config key override it; see configs/default.toml.
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use headroom_core::RunConfig;

#[derive(Debug, Parser)]
#[command(
    name = "headroom",
    version,
    about = "Train a model and watch its memory headroom live in the terminal"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Commands,
}

#[derive(Debug, Subcommand)]
pub enum Commands {
    /// Train a byte-level GPT with a live memory dashboard (headless when not a terminal)
    Train(TrainArgs),
}

#[derive(Debug, Clone, Default, Args)]
pub struct TrainArgs {
    /// TOML config (default: the built-in defaults, same as configs/default.toml)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Text file to train on (default: bundled tinyshakespeare)
    #[arg(long, value_name = "FILE")]
    pub corpus: Option<PathBuf>,
    /// auto, cpu, cuda or cuda:N
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<String>,
    /// Total optimizer steps (including resumed ones)
    #[arg(long, value_name = "N")]
    pub steps: Option<u64>,
    /// Micro-batch: sequences per forward/backward pass
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,
    /// Sequences per optimizer step (micro-batches are accumulated to reach it)
    #[arg(long, value_name = "N")]
    pub effective_batch: Option<usize>,
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// No dashboard: progress lines on stderr (automatic when stdout is not a terminal)
    #[arg(long)]
    pub headless: bool,
    /// Write every telemetry record and event as JSON lines (docs/LOG_SCHEMA.md)
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// Where checkpoints go (default: runs/<run name>)
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Continue a run from its checkpoint directory (or one step-NNNNNN directory in it)
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
}

impl TrainArgs {
    /// The config this run uses: the file (or defaults) with the flags applied, or, when
    /// resuming, the checkpoint's own config with only the flags that cannot change what
    /// is learned.
    pub fn resolve(&self, resumed: Option<RunConfig>) -> Result<RunConfig> {
        let mut cfg = match resumed {
            Some(cfg) => {
                if self.config.is_some() {
                    bail!("--resume takes the run's config from its checkpoint; drop --config");
                }
                for (flag, given) in [
                    ("--corpus", self.corpus.is_some()),
                    ("--effective-batch", self.effective_batch.is_some()),
                    ("--seed", self.seed.is_some()),
                ] {
                    if given {
                        bail!("{flag} cannot change when resuming (it would change what is learned); drop it or start a new run");
                    }
                }
                cfg
            }
            None => match &self.config {
                Some(path) => RunConfig::load(path)?,
                None => RunConfig::default(),
            },
        };
        if let Some(c) = &self.corpus {
            cfg.data.corpus = c.to_string_lossy().into_owned();
        }
        if let Some(d) = &self.device {
            cfg.run.device = d.clone();
        }
        if let Some(n) = self.steps {
            cfg.run.steps = n;
        }
        if let Some(n) = self.batch_size {
            cfg.batch.micro_batch = n;
        }
        if let Some(n) = self.effective_batch {
            cfg.batch.effective_batch = n;
        }
        if let Some(n) = self.seed {
            cfg.run.seed = n;
        }
        if let Some(dir) = &self.checkpoint_dir {
            cfg.run.checkpoint_dir = dir.to_string_lossy().into_owned();
        }
        cfg.validate().context("invalid configuration")?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> TrainArgs {
        let mut argv = vec!["headroom", "train"];
        argv.extend_from_slice(list);
        match Cli::try_parse_from(argv).unwrap().command {
            Commands::Train(a) => a,
        }
    }

    #[test]
    fn flags_override_config_keys() {
        let cfg = args(&[
            "--steps",
            "7",
            "--batch-size",
            "4",
            "--effective-batch",
            "12",
        ])
        .resolve(None)
        .unwrap();
        assert_eq!(cfg.run.steps, 7);
        assert_eq!((cfg.batch.micro_batch, cfg.batch.effective()), (4, 12));
    }

    #[test]
    fn zero_batch_is_an_error_naming_the_flag() {
        let err = args(&["--batch-size", "0"]).resolve(None).unwrap_err();
        assert!(format!("{err:#}").contains("--batch-size"), "{err:#}");
    }

    #[test]
    fn resume_refuses_flags_that_change_learning() {
        let err = args(&["--seed", "3"])
            .resolve(Some(RunConfig::default()))
            .unwrap_err();
        assert!(err.to_string().contains("--seed"), "{err}");
        let cfg = args(&["--steps", "900"])
            .resolve(Some(RunConfig::default()))
            .unwrap();
        assert_eq!(cfg.run.steps, 900);
    }
}
