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

/// What a rank's child sees as its one GPU for `--devices` entry `device`: the entry itself,
/// or, when this process was already given a `CUDA_VISIBLE_DEVICES` list, that list's entry
/// at the index `device` names (`--devices 0,1` under `CUDA_VISIBLE_DEVICES=2,3` are GPUs 2
/// and 3, as inside the parent).
pub fn child_visible_device(device: &str, parent: Option<&str>) -> anyhow::Result<String> {
    let Some(parent) = parent else {
        return Ok(device.to_string());
    };
    let visible: Vec<&str> = parent
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    match device.trim().parse::<usize>() {
        Ok(i) if i < visible.len() => Ok(visible[i].to_string()),
        Ok(i) => anyhow::bail!(
            "--devices names GPU {i}, but this process sees {} (CUDA_VISIBLE_DEVICES={parent:?})",
            visible.len()
        ),
        // A UUID or MIG name is passed through as given.
        Err(_) => Ok(device.to_string()),
    }
}

/// How ranks end: every one waited for, or, for ranks that meet in collectives, the others
/// stopped once one fails (the others would wait for it in NCCL, which has no timeout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnRankFailure {
    LetOthersFinish,
    StopOthers,
}

/// Waits for every rank's process; returns one line per rank that failed (or was stopped),
/// naming its log.
pub fn wait_for_ranks(
    mut children: Vec<(usize, PathBuf, std::process::Child)>,
    on_failure: OnRankFailure,
) -> anyhow::Result<Vec<String>> {
    let mut failed = Vec::new();
    while !children.is_empty() {
        let mut i = 0;
        let mut stop = false;
        while i < children.len() {
            match children[i].2.try_wait()? {
                Some(status) => {
                    let (rank, log_path, _) = children.remove(i);
                    if !status.success() {
                        failed.push(format!("rank {rank} ({status}; {})", log_path.display()));
                        stop = on_failure == OnRankFailure::StopOthers;
                    }
                }
                None => i += 1,
            }
        }
        if stop {
            for (rank, log_path, mut child) in children.drain(..) {
                let _ = child.kill();
                let _ = child.wait();
                failed.push(format!(
                    "rank {rank} (stopped after another rank failed; {})",
                    log_path.display()
                ));
            }
        }
        if !children.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
    Ok(failed)
}

/// Runs this command again once per device in `devices`, as ranks 0..N-1, in parallel (each
/// with only its GPU visible, NVLink multicast off, logs in `out/rank-i.log`); fails when a
/// rank fails, naming its log. `what` names the job in messages.
pub fn run_on_devices(
    devices: &[String],
    out: &Path,
    what: &str,
    on_failure: OnRankFailure,
) -> anyhow::Result<()> {
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
    let parent_visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let visible = devices
        .iter()
        .map(|d| child_visible_device(d, parent_visible.as_deref()))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut children: Vec<(usize, PathBuf, std::process::Child)> = Vec::with_capacity(world);
    for (rank, device) in visible.iter().enumerate() {
        let log_path = out.join(format!("rank-{rank}.log"));
        let started = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))
            .and_then(|log| {
                std::process::Command::new(&exe)
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
                    .with_context(|| format!("starting rank {rank} on device {device}"))
            });
        let child = match started {
            Ok(child) => child,
            Err(e) => {
                // The ranks already started would wait for this one (in NCCL, for good).
                for (_, _, mut child) in children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(e);
            }
        };
        eprintln!(
            "{what}: rank {rank} of {world} on device {device}: log {}",
            log_path.display()
        );
        children.push((rank, log_path, child));
    }
    let failed = wait_for_ranks(children, on_failure)?;
    if !failed.is_empty() {
        anyhow::bail!("{what}: {} failed", failed.join(", "));
    }
    Ok(())
}

/// Where rank 0 publishes the NCCL id unless told: `out/nccl-id`.
pub fn default_rendezvous(out: &Path, given: Option<&PathBuf>) -> PathBuf {
    given.cloned().unwrap_or_else(|| out.join("nccl-id"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_index_the_parents_visible_list() {
        let visible = |d, parent| child_visible_device(d, parent).map_err(|e| e.to_string());
        assert_eq!(visible("1", Some("2,3")).unwrap(), "3");
        assert_eq!(visible("0", Some(" 2 , 3 ")).unwrap(), "2");
        // Without a list the entry as given; a UUID as given.
        assert_eq!(visible("1", None).unwrap(), "1");
        assert_eq!(visible("GPU-ab12", Some("2,3")).unwrap(), "GPU-ab12");
        // Past the parent's list (or an empty one): a GPU this process was not given.
        let err = visible("4", Some("2,3")).unwrap_err();
        assert!(
            err.contains("names GPU 4, but this process sees 2"),
            "{err}"
        );
        assert!(visible("0", Some("")).is_err());
    }

    fn spawn(script: &str) -> std::process::Child {
        std::process::Command::new("sh")
            .args(["-c", script])
            .spawn()
            .expect("sh")
    }

    #[test]
    fn a_failed_collective_rank_stops_the_others() {
        let start = std::time::Instant::now();
        let children = vec![
            (0, PathBuf::from("rank-0.log"), spawn("sleep 30")),
            (1, PathBuf::from("rank-1.log"), spawn("exit 3")),
        ];
        let failed = wait_for_ranks(children, OnRankFailure::StopOthers).unwrap();
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(
            failed[0].starts_with("rank 1 (exit status: 3"),
            "{failed:?}"
        );
        assert!(failed[1].starts_with("rank 0 (stopped after another rank failed"));
    }

    #[test]
    fn independent_ranks_finish_after_one_fails() {
        let children = vec![
            (0, PathBuf::from("rank-0.log"), spawn("sleep 1; exit 0")),
            (1, PathBuf::from("rank-1.log"), spawn("exit 2")),
            (2, PathBuf::from("rank-2.log"), spawn("sleep 1; exit 4")),
        ];
        let mut failed = wait_for_ranks(children, OnRankFailure::LetOthersFinish).unwrap();
        failed.sort();
        assert_eq!(failed.len(), 2, "{failed:?}");
        assert!(
            failed[0].starts_with("rank 1 (exit status: 2"),
            "{failed:?}"
        );
        assert!(
            failed[1].starts_with("rank 2 (exit status: 4"),
            "{failed:?}"
        );
    }
}
