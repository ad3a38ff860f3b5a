//! Data-parallel replicas over NCCL: one process per GPU (as torchrun or `tandem train
//! --devices` starts them), joined into one communicator bootstrapped the way a multi-node run
//! is: rank 0 makes the NCCL unique id and publishes it through a file on a shared filesystem
//! and the others wait for it (or, with `NCCL_COMM_ID=HOST:PORT` on every rank, NCCL's own
//! rendezvous at rank 0's address).
//!
//! The reductions themselves are NCCL's (`ncclAllReduce` on the trainer's stream, so they are
//! ordered with its kernels); nothing here reduces over host memory.

// Only to ask whether libnccl can be loaded before cudarc would panic on it.
#![allow(unsafe_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};

use crate::device::Gpu;
use crate::error::CudaError;

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const NCCL_ID_BYTES: usize = 128;

/// An NCCL unique id as bytes.
pub type NcclId = [u8; NCCL_ID_BYTES];

/// NCCL's own rendezvous without a shared filesystem, `HOST:PORT` of rank 0's machine (what
/// torchrun's MASTER_ADDR:MASTER_PORT is): set on every rank, each makes the same id from the
/// address, and rank 0's `ncclCommInitRank` listens there. (An id printed by a process that
/// then exits cannot serve: `ncclGetUniqueId` starts the listener inside the calling
/// process.)
pub const NCCL_COMM_ID_ENV: &str = "NCCL_COMM_ID";

/// One rank's place in a group of processes, as torchrun describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessGroup {
    /// This process (0-based, unique across machines).
    pub rank: usize,
    /// Processes in the group.
    pub world_size: usize,
    /// Where the id comes from: a file every rank can read (rank 0 writes it), unless
    /// `NCCL_COMM_ID` is set.
    pub rendezvous: PathBuf,
    /// A tag naming this launch (`TANDEM_RUN_ID`, else torchrun's `TORCHELASTIC_RUN_ID`):
    /// ranks only accept an id file carrying their own tag, so a file left by an earlier run
    /// in the same directory is never joined.
    pub run_tag: String,
}

/// The hex text of an id (256 characters).
pub fn encode_id(id: &NcclId) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses [`encode_id`]'s text, naming what is wrong with it.
pub fn decode_id(text: &str) -> Result<NcclId, CudaError> {
    let text = text.trim();
    if text.len() != 2 * NCCL_ID_BYTES {
        return Err(CudaError::Collective(format!(
            "an NCCL id is {} hex characters; got {}",
            2 * NCCL_ID_BYTES,
            text.len()
        )));
    }
    let mut id = [0u8; NCCL_ID_BYTES];
    for (i, byte) in id.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16)
            .map_err(|e| CudaError::Collective(format!("NCCL id character {}: {e}", 2 * i)))?;
    }
    Ok(id)
}

/// Writes `id` with `tag` to `path` under a temporary name and renames it into place, so a
/// waiting rank never reads half a file.
pub fn publish_id(path: &Path, tag: &str, id: &NcclId) -> Result<(), CudaError> {
    let io = |what: &str, p: &Path, e: std::io::Error| {
        CudaError::Collective(format!("{what} {}: {e}", p.display()))
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, format!("{tag}\n{}\n", encode_id(id)))
        .map_err(|e| io("writing", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io("renaming into", path, e))
}

/// Waits until `path` holds an id published with `tag` (polling every 50 ms), up to
/// `timeout`.
pub fn wait_for_id(path: &Path, tag: &str, timeout: Duration) -> Result<NcclId, CudaError> {
    let start = Instant::now();
    let mut seen_other_tag = None;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            let mut lines = text.lines();
            let (file_tag, hex) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""));
            if file_tag == tag {
                return decode_id(hex);
            }
            seen_other_tag = Some(file_tag.to_owned());
        }
        if start.elapsed() >= timeout {
            let why = match seen_other_tag {
                Some(other) => format!(
                    "it holds the id of run {other:?}, not of this run {tag:?} (a file left by \
                     an earlier launch: give every rank the same fresh TANDEM_RUN_ID)"
                ),
                None => "it never appeared (did rank 0 start, and is the path on a \
                         filesystem every rank sees?)"
                    .to_owned(),
            };
            return Err(CudaError::Collective(format!(
                "waited {:.0}s for rank 0's NCCL id in {}: {why}",
                timeout.as_secs_f64(),
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn nccl_err(what: &str) -> impl Fn(cudarc::nccl::result::NcclError) -> CudaError + '_ {
    move |e| CudaError::Collective(format!("{what}: {e:?}"))
}

/// Whether libnccl can be loaded (an error naming the fix if not).
pub fn nccl_present() -> Result<(), CudaError> {
    // cudarc panics when libnccl cannot be loaded; ask first.
    // SAFETY: this only tries to dlopen the library.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::MissingLibrary(
            "libnccl (NCCL; pip's nvidia-nccl-cu12 ships libnccl.so.2: put a libnccl.so link \
             to it on LD_LIBRARY_PATH, as scripts/gpu/nccl_env.sh does)",
        ))
    }
}

/// Refuses a file rendezvous of several ranks without a tag of their own launch: with an
/// empty tag (or torchrun's `none`, the same at every launch) a rank could join the id an
/// earlier launch left in the file, whose listener is gone, and hang.
pub fn check_run_tag(group: &ProcessGroup) -> Result<(), CudaError> {
    let tag = group.run_tag.trim();
    if group.world_size > 1 && (tag.is_empty() || tag == "none") {
        return Err(CudaError::Collective(format!(
            "{} ranks meet through {} with no tag of this launch: set the same fresh \
             TANDEM_RUN_ID on every rank (tandem train --devices and scripts/train_dp.sh do)",
            group.world_size,
            group.rendezvous.display()
        )));
    }
    Ok(())
}

/// A fresh NCCL unique id (what rank 0 publishes).
pub fn new_nccl_id() -> Result<NcclId, CudaError> {
    nccl_present()?;
    let id = Id::new().map_err(nccl_err("ncclGetUniqueId"))?;
    Ok(id.internal().map(|c| c as u8))
}

/// An NCCL communicator over the replicas, bound to this process's GPU stream.
pub struct Collective {
    comm: Comm,
    gpu: Arc<Gpu>,
}

impl std::fmt::Debug for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Collective(rank {} of {})",
            self.comm.rank(),
            self.comm.world_size()
        )
    }
}

impl Collective {
    /// Joins `group` on `gpu`: rank 0 makes and publishes the id, the others wait up to
    /// `timeout` for it (or, with `NCCL_COMM_ID` set, every rank makes the id of that
    /// address); then `ncclCommInitRank`, which returns once every rank has joined.
    pub fn bootstrap(
        gpu: &Arc<Gpu>,
        group: &ProcessGroup,
        timeout: Duration,
    ) -> Result<Self, CudaError> {
        nccl_present()?;
        if group.world_size == 0 || group.rank >= group.world_size {
            return Err(CudaError::Collective(format!(
                "rank {} of a group of {}",
                group.rank, group.world_size
            )));
        }
        let id = if std::env::var_os(NCCL_COMM_ID_ENV).is_some() {
            new_nccl_id()?
        } else if group.rank == 0 {
            check_run_tag(group)?;
            let id = new_nccl_id()?;
            publish_id(&group.rendezvous, &group.run_tag, &id)?;
            id
        } else {
            check_run_tag(group)?;
            wait_for_id(&group.rendezvous, &group.run_tag, timeout)?
        };
        Self::join(gpu, group.rank, group.world_size, &id)
    }

    /// Joins the communicator of `id` as `rank` of `world_size`.
    pub fn join(
        gpu: &Arc<Gpu>,
        rank: usize,
        world_size: usize,
        id: &NcclId,
    ) -> Result<Self, CudaError> {
        nccl_present()?;
        let id = Id::uninit(id.map(|b| b as core::ffi::c_char));
        let comm = Comm::from_rank(gpu.stream().clone(), rank, world_size, id)
            .map_err(nccl_err("ncclCommInitRank"))?;
        Ok(Collective {
            comm,
            gpu: Arc::clone(gpu),
        })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Sums `buffer` over the ranks, in place, on the GPU's stream.
    pub fn all_reduce_sum<T: NcclType>(&self, buffer: &mut CudaSlice<T>) -> Result<(), CudaError> {
        self.comm
            .all_reduce_in_place(buffer, &ReduceOp::Sum)
            .map_err(nccl_err("ncclAllReduce"))?;
        Ok(())
    }

    /// Whether any rank says `flag` (one tiny all-reduce): how the replicas agree to stop on
    /// a wall-clock limit each of them measures on its own.
    pub fn any(&self, flag: bool) -> Result<bool, CudaError> {
        let stream = self.gpu.stream();
        let mut value = stream.clone_htod(&[f64::from(u8::from(flag))])?;
        self.comm
            .all_reduce_in_place(&mut value, &ReduceOp::Max)
            .map_err(nccl_err("ncclAllReduce"))?;
        Ok(stream.clone_dtoh(&value)?[0] > 0.0)
    }

    /// The largest `value` over the ranks (one tiny all-reduce): how the replicas agree on a
    /// number each measures on its own (the step times the learning-rate horizon is fitted to).
    pub fn max(&self, value: f64) -> Result<f64, CudaError> {
        let stream = self.gpu.stream();
        let mut buffer = stream.clone_htod(&[value])?;
        self.comm
            .all_reduce_in_place(&mut buffer, &ReduceOp::Max)
            .map_err(nccl_err("ncclAllReduce"))?;
        Ok(stream.clone_dtoh(&buffer)?[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_id() -> NcclId {
        std::array::from_fn(|i| (i * 37 + 11) as u8)
    }

    #[test]
    fn ids_round_trip_through_hex_and_bad_text_is_named() {
        let id = sample_id();
        let text = encode_id(&id);
        assert_eq!(text.len(), 256);
        assert_eq!(decode_id(&format!("  {text}\n")).unwrap(), id);
        let short = decode_id(&text[..254]).unwrap_err().to_string();
        assert!(short.contains("256 hex characters; got 254"), "{short}");
        let mut bad = text.clone();
        bad.replace_range(10..12, "zz");
        let err = decode_id(&bad).unwrap_err().to_string();
        assert!(err.contains("character 10"), "{err}");
    }

    #[test]
    fn several_ranks_need_a_tag_of_their_launch() {
        let group = |world_size, tag: &str| ProcessGroup {
            rank: 0,
            world_size,
            rendezvous: PathBuf::from("out/nccl-id"),
            run_tag: tag.to_owned(),
        };
        assert!(
            check_run_tag(&group(1, "")).is_ok(),
            "one rank meets nobody"
        );
        assert!(check_run_tag(&group(2, "run-17")).is_ok());
        for tag in ["", "none", " "] {
            let err = check_run_tag(&group(2, tag)).unwrap_err().to_string();
            assert!(err.contains("TANDEM_RUN_ID"), "{tag:?}: {err}");
        }
    }

    #[test]
    fn a_waiting_rank_reads_the_id_rank_zero_publishes_later() {
        let dir = std::env::temp_dir().join(format!("tandem-rdv-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("nccl-id");
        let id = sample_id();
        let waiter = {
            let path = path.clone();
            std::thread::spawn(move || wait_for_id(&path, "run-7", Duration::from_secs(20)))
        };
        std::thread::sleep(Duration::from_millis(200));
        publish_id(&path, "run-7", &id).unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), id);
        // No temporary file is left next to it.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(names.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_left_by_another_run_is_never_joined() {
        let dir = std::env::temp_dir().join(format!("tandem-rdv-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("nccl-id");
        publish_id(&path, "old-run", &sample_id()).unwrap();
        let err = wait_for_id(&path, "new-run", Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"old-run\"") && err.contains("TANDEM_RUN_ID"),
            "{err}"
        );
        let missing = wait_for_id(&dir.join("absent"), "x", Duration::from_millis(100))
            .unwrap_err()
            .to_string();
        assert!(missing.contains("never appeared"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
