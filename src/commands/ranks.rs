//! One process per GPU, as torchrun starts them: `--devices A,B,..` re-runs the same command
//! once per device with RANK / WORLD_SIZE / LOCAL_RANK set, each child seeing only its GPU,
//! and the ranks' own `--rank` / `--world-size` (else the torchrun environment). Shared by
//! `tandem dump` and `tandem train`.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// A count from the environment (`RANK=3`), named in the error when it is not one.
pub fn env_count(name: &str) -> anyhow::Result<Option<usize>> {
    match std::env::var(name) {
        Ok(v) => {
            Ok(Some(v.trim().parse().map_err(|e| {
                anyhow::anyhow!("{name}={v:?} is not a count: {e}")
            })?))
        }
        Err(_) => Ok(None),
    }
}

/// `(rank, world_size)` from the flags, else torchrun's RANK / WORLD_SIZE; `None` for one
/// process.
pub fn rank_and_world(
    rank: Option<usize>,
    world_size: Option<usize>,
) -> anyhow::Result<Option<(usize, usize)>> {
    let world_size = match world_size {
        Some(w) => Some(w),
        None => env_count("WORLD_SIZE")?,
    };
    let rank = match rank {
        Some(r) => Some(r),
        None => env_count("RANK")?,
    };
    match (rank, world_size) {
        (None, None) => Ok(None),
        (Some(rank), Some(world)) if rank < world => Ok(Some((rank, world))),
        (Some(rank), Some(world)) => anyhow::bail!("rank {rank} of a world of {world}"),
        (Some(_), None) => anyhow::bail!("--rank needs --world-size (or WORLD_SIZE)"),
        (None, Some(_)) => anyhow::bail!("--world-size needs --rank (or RANK)"),
    }
}

/// The CUDA ordinal of this rank: 0 when CUDA_VISIBLE_DEVICES leaves one GPU (as `--devices`
/// starts the ranks), else LOCAL_RANK (torchrun on a machine whose GPUs are all visible).
pub fn local_device() -> anyhow::Result<usize> {
    let one_visible = std::env::var("CUDA_VISIBLE_DEVICES")
        .is_ok_and(|v| !v.trim().is_empty() && !v.contains(','));
    if one_visible {
        return Ok(0);
    }
    Ok(env_count("LOCAL_RANK")?.unwrap_or(0))
}

/// The launch's tag: TANDEM_RUN_ID, else torchrun's TORCHELASTIC_RUN_ID, else empty.
pub fn run_tag() -> String {
    std::env::var("TANDEM_RUN_ID")
        .or_else(|_| std::env::var("TORCHELASTIC_RUN_ID"))
        .unwrap_or_default()
}

/// Runs this command again once per device in `devices`, as ranks 0..N-1, in parallel (each
/// with only its GPU visible, NVLink multicast off, logs in `out/rank-i.log`); fails when a
/// rank fails, naming its log. `what` names the job in messages.
pub fn run_on_devices(devices: &[String], out: &Path, what: &str) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding the tandem binary to start the ranks")?;
    // The same arguments without --devices (both `--devices X` and `--devices=X`).
    let mut forwarded = Vec::new();
    let mut argv = std::env::args_os().skip(1);
    while let Some(arg) = argv.next() {
        let text = arg.to_string_lossy();
        if text == "--devices" {
            argv.next();
        } else if !text.starts_with("--devices=") {
            forwarded.push(arg);
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    // A fresh tag per launch: no rank joins an id file an earlier launch left in `out`.
    let tag = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let world = devices.len();
    let mut children = Vec::with_capacity(world);
    for (rank, device) in devices.iter().enumerate() {
        let log_path = out.join(format!("rank-{rank}.log"));
        let log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        let child = std::process::Command::new(&exe)
            .args(&forwarded)
            .env("CUDA_VISIBLE_DEVICES", device)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("TANDEM_RUN_ID", &tag)
            .env("NCCL_NVLS_ENABLE", "0")
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting rank {rank} on device {device}"))?;
        eprintln!(
            "{what}: rank {rank} of {world} on device {device}: log {}",
            log_path.display()
        );
        children.push((rank, log_path, child));
    }
    let mut failed = Vec::new();
    for (rank, log_path, mut child) in children {
        let status = child.wait()?;
        if !status.success() {
            failed.push(format!("rank {rank} ({status}; {})", log_path.display()));
        }
    }
    if !failed.is_empty() {
        anyhow::bail!("{what}: {} failed", failed.join(", "));
    }
    Ok(())
}

/// Where rank 0 publishes the NCCL id unless told: `out/nccl-id`.
pub fn default_rendezvous(out: &Path, given: Option<&PathBuf>) -> PathBuf {
    given.cloned().unwrap_or_else(|| out.join("nccl-id"))
}
