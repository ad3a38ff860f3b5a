//! `tandem train --device cuda`: the run of [`crate::trainer::train`] (same checks, split,
//! draft vocabulary, initialisation, batch plan, schedule, clipping, metrics, checkpoints and
//! export) on [`tandem_cuda::CudaHeadTrainer`], the hand-written GPU trainer.
//!
//! The data pass reads the dumps once, on every core (one reader per thread over a contiguous
//! range of rows), and puts the whole corpus on the GPU as bf16 (the dump's own precision):
//! 4 taps of a 576-wide target are 4.6 KB per token, so 5M tokens take 23 GB of the H200's
//! 141. Batches are then gathered on the GPU; the host only builds index lists.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::{Autodiff, NdArray};
use burn::prelude::*;
use safetensors::tensor::{Dtype, TensorView};
use tandem_cuda::{
    AdamWStep, Collective, CorpusBatch, CudaHeadTrainer, Gpu, MAX_TTT_STEPS, ProcessGroup,
    Replicas, TargetPieces,
};
use tandem_eagle::{Eagle3Config, Eagle3Draft, WeightDtype, load_pretrained, save_pretrained};
use tandem_wiring::DumpRef;

use crate::data::{Dataset, RowInfo};
use crate::driver::{Run, StepEngine, StepOutcome, run_schedule, wall_clock};
use crate::error::TrainError;
use crate::metrics::{MetricsLog, StatsSum, read_lines};
use crate::objective::StepStats;
use crate::plot;
use crate::replicas::replica_share;
use crate::target::TargetHead;
use crate::trainer::{
    CHECKPOINT_DIR, CURVES_FILE, METRICS_FILE, OPTIONS_FILE, TrainOptions, TrainReport, TrainState,
    check_data, checkpoint_name, engine_ids, export_config, fresh_model, fresh_state, index_row,
    prune_checkpoints, resume_state, write_json,
};

/// AdamW moments of a GPU checkpoint (flat, in the trainer's parameter layout).
const ADAM_FILE: &str = "adam.safetensors";

/// One row of the corpus: where its tokens start on the GPU, and its ids and loss mask.
#[derive(Debug, Clone)]
struct CorpusRow {
    start: usize,
    input_ids: Vec<u32>,
    loss_mask: Vec<u8>,
}

/// What one loader thread read: its rows (global index, validation or not) and their bf16
/// aux/last rows, concatenated.
#[derive(Default)]
struct LoadedChunk {
    rows: Vec<(RowInfo, bool, Vec<u32>, Vec<u8>)>,
    aux: Vec<u16>,
    last: Vec<u16>,
    counts: Vec<u64>,
}

fn to_bf16_bits(values: &[f32], out: &mut Vec<u16>) {
    // The dump stores bf16; the reader widened it to f32, so this is exact.
    out.extend(values.iter().map(|&v| half::bf16::from_f32(v).to_bits()));
}

fn load_range(
    options: &TrainOptions,
    shared: Option<&Dataset>,
    range: std::ops::Range<usize>,
    slots: usize,
    hidden: usize,
    vocab: usize,
) -> Result<LoadedChunk, TrainError> {
    // Each thread opens the dumps itself (a shard reader serves one thread); an online source
    // is shared (its one target captures one row at a time).
    let own;
    let data = match shared {
        Some(data) => data,
        None => {
            own = Dataset::open(&options.dumps)?;
            &own
        }
    };
    let mut chunk = LoadedChunk {
        counts: vec![0; vocab],
        ..Default::default()
    };
    for index in range {
        let r = data.read(index)?;
        let Some((info, val)) = index_row(&r, index, options, slots, hidden, &mut chunk.counts)?
        else {
            continue;
        };
        let len = info.len;
        to_bf16_bits(&r.aux_hidden[..len * slots * hidden], &mut chunk.aux);
        to_bf16_bits(&r.last_hidden[..len * hidden], &mut chunk.last);
        chunk.rows.push((
            info,
            val,
            r.input_ids[..len].to_vec(),
            r.loss_mask[..len].to_vec(),
        ));
    }
    Ok(chunk)
}

/// Reads every row on all cores (an online source: on one thread, it captures on the GPU).
fn load_all(
    options: &TrainOptions,
    shared: Option<&Dataset>,
    rows: usize,
    slots: usize,
    hidden: usize,
    vocab: usize,
) -> Result<Vec<LoadedChunk>, TrainError> {
    let threads = if shared.is_some() {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .clamp(1, 16)
            .min(rows.max(1))
    };
    let per = rows.div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let range = (t * per).min(rows)..((t + 1) * per).min(rows);
                scope.spawn(move || load_range(options, shared, range, slots, hidden, vocab))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("loader thread panicked"))
            .collect()
    })
}

/// The NCCL process group of a data-parallel replica.
fn group_of(dp: &crate::replicas::DataParallel) -> ProcessGroup {
    ProcessGroup {
        rank: dp.rank,
        world_size: dp.world_size,
        rendezvous: dp.rendezvous.clone(),
        run_tag: dp.run_tag.clone(),
    }
}

fn cuda_err(e: tandem_cuda::CudaError) -> TrainError {
    TrainError::Gpu {
        reason: e.to_string(),
    }
}

/// Builds the GPU batch of global rows `rows`.
fn corpus_batch(rows: &[usize], corpus: &[Option<CorpusRow>]) -> CorpusBatch {
    corpus_batch_padded(rows, corpus, batch_width(rows, corpus))
}

fn row_len(corpus: &[Option<CorpusRow>], i: usize) -> usize {
    corpus[i]
        .as_ref()
        .expect("planned rows are loaded")
        .input_ids
        .len()
}

/// The padded width of a batch of `rows`: its longest row.
fn batch_width(rows: &[usize], corpus: &[Option<CorpusRow>]) -> usize {
    rows.iter().map(|&i| row_len(corpus, i)).max().unwrap_or(0)
}

/// [`corpus_batch`] padded to `width` (a replica's share, padded as the global batch is).
fn corpus_batch_padded(rows: &[usize], corpus: &[Option<CorpusRow>], width: usize) -> CorpusBatch {
    let picked: Vec<&CorpusRow> = rows
        .iter()
        .map(|&i| corpus[i].as_ref().expect("planned rows are loaded"))
        .collect();
    let lengths: Vec<usize> = picked.iter().map(|r| r.input_ids.len()).collect();
    let mut input_ids = vec![0u32; picked.len() * width];
    let mut loss_mask = vec![0u8; picked.len() * width];
    for (b, r) in picked.iter().enumerate() {
        let n = r.input_ids.len();
        input_ids[b * width..b * width + n].copy_from_slice(&r.input_ids);
        loss_mask[b * width..b * width + n].copy_from_slice(&r.loss_mask);
    }
    CorpusBatch {
        starts: picked.iter().map(|r| r.start).collect(),
        lengths,
        width,
        input_ids,
        loss_mask,
    }
}

fn to_stats(counts: &[tandem_cuda::StepCounts]) -> Vec<StepStats> {
    counts
        .iter()
        .map(|c| StepStats {
            loss: c.loss,
            correct: c.correct,
            denominator: c.denominator,
        })
        .collect()
}

/// Trains on the GPU. Same options, outputs and resume rules as [`crate::train`].
pub fn train_gpu(options: &TrainOptions) -> Result<TrainReport, TrainError> {
    train_gpu_with(options, None)
}

/// [`train_gpu`] on an already opened dataset (`--online`: rows captured from the target),
/// read once onto the GPU through one shared reader.
pub fn train_gpu_on(options: &TrainOptions, data: Dataset) -> Result<TrainReport, TrainError> {
    train_gpu_with(options, Some(data))
}

fn train_gpu_with(
    options: &TrainOptions,
    opened: Option<Dataset>,
) -> Result<TrainReport, TrainError> {
    options.validate()?;
    if options.ttt_steps > MAX_TTT_STEPS {
        return Err(TrainError::InvalidOption {
            option: "ttt-steps",
            reason: format!(
                "{} exceeds the GPU trainer's {MAX_TTT_STEPS}",
                options.ttt_steps
            ),
        });
    }
    // A replica joins NCCL only after minutes of loading: what would stop it there is asked
    // now (a missing libnccl, ranks without a tag of their launch).
    if let Some(dp) = &options.data_parallel {
        tandem_cuda::collective::nccl_present().map_err(cuda_err)?;
        if std::env::var_os(tandem_cuda::collective::NCCL_COMM_ID_ENV).is_none() {
            tandem_cuda::collective::check_run_tag(&group_of(dp)).map_err(cuda_err)?;
        }
    }
    let start = Instant::now();
    std::fs::create_dir_all(&options.out).map_err(TrainError::io("create", &options.out))?;
    let shared = opened.is_some();
    let data = match opened {
        Some(data) => data,
        None => Dataset::open(&options.dumps)?,
    };
    let wiring = check_data(options, &data)?;
    let cpu = Default::default();
    let head = TargetHead::<NdArray>::load(&options.model, &cpu)?;
    let spec = head.spec.clone();
    let hidden = spec.hidden_size;
    let slots = wiring.taps.len();
    let engine_ids = engine_ids(&wiring, spec.num_layers)?;

    // One pass over the data on every core.
    let load_start = Instant::now();
    let chunks = load_all(
        options,
        shared.then_some(&data),
        data.len(),
        slots,
        hidden,
        spec.vocab_size,
    )?;
    let read_seconds = load_start.elapsed().as_secs_f64();
    let mut counts = vec![0u64; spec.vocab_size];
    let mut train_rows = Vec::new();
    let mut val_rows = Vec::new();
    let mut corpus_tokens = 0usize;
    for chunk in &chunks {
        for (c, &n) in counts.iter_mut().zip(&chunk.counts) {
            *c += n;
        }
        for (info, val, _, _) in &chunk.rows {
            corpus_tokens += info.len;
            if *val {
                val_rows.push(info.clone());
            } else {
                train_rows.push(info.clone());
            }
        }
    }
    if train_rows.is_empty() {
        return Err(TrainError::NoData {
            reason: format!(
                "{} rows, {} in validation, none left to train on (rows need at least 3 tokens)",
                data.len(),
                val_rows.len()
            ),
        });
    }
    let batches_per_epoch = train_rows.len().div_ceil(options.batch_size);
    let total_steps = batches_per_epoch * options.epochs;

    // The head: resumed, from --init-from, or fresh (the burn trainer's initialisation).
    let embed = || head.embed_tokens.clone();
    let identity = options.identity();
    let (draft, base_config, state, resumed_from, adam) = if options.resume {
        let (dir, state) = resume_state(options, &identity, data.len(), train_rows.len())?;
        let adam_path = dir.join(ADAM_FILE);
        if !adam_path.is_file() {
            return Err(TrainError::Resume {
                path: options.out.clone(),
                reason: format!(
                    "{} has no {ADAM_FILE}: it was written by the burn trainer (resume it \
                     with --engine burn)",
                    dir.display()
                ),
            });
        }
        let adam = read_adam(&adam_path)?;
        let loaded = load_pretrained::<NdArray>(&dir.join("head"), embed(), &cpu)?;
        let step = state.step;
        (loaded.draft, loaded.config, state, Some(step), Some(adam))
    } else {
        let (model, config) = fresh_model::<Autodiff<NdArray>>(
            options,
            &head,
            &wiring,
            &counts,
            Tensor::from_inner(embed()),
            &cpu,
        )?;
        let state = fresh_state(options, identity, data.len(), train_rows.len(), total_steps)?;
        (
            Eagle3Draft::<NdArray>::from_host(
                model.spec.clone(),
                model.vocab.clone(),
                &model.to_host(),
                embed(),
                &cpu,
            )?,
            config,
            state,
            None,
            None,
        )
    };
    let init_seconds = load_start.elapsed().as_secs_f64() - read_seconds;
    let trained_on: Vec<DumpRef> = data.sources().iter().map(|s| s.dump_ref()).collect();
    let export_config = export_config(
        &base_config,
        &wiring,
        &engine_ids,
        &trained_on,
        resumed_from.is_some(),
        &options.device_label,
    )?;
    let primary = options
        .data_parallel
        .as_ref()
        .is_none_or(|dp| dp.is_primary());
    if primary {
        write_json(&options.out.join(OPTIONS_FILE), options)?;
    }

    // The trainer and the corpus on the GPU, then replicas join their communicator (it returns
    // once every rank is there).
    let target = head.host_pieces();
    let draft_ids = draft.vocab.target_ids();
    let gpu =
        Gpu::new(options.data_parallel.as_ref().map_or(0, |dp| dp.device)).map_err(cuda_err)?;
    let mut trainer = CudaHeadTrainer::new(
        Arc::clone(&gpu),
        draft.spec.clone(),
        &draft.to_host(),
        &TargetPieces {
            embed_tokens: &target.embed_tokens,
            norm: &target.norm,
            lm_head: &target.lm_head,
            draft_ids: &draft_ids,
        },
    )
    .map_err(cuda_err)?;
    if let Some((m1, m2)) = &adam {
        trainer
            .load_optimizer_state(m1, m2, state.step as u64)
            .map_err(cuda_err)?;
    }
    let setup_seconds = load_start.elapsed().as_secs_f64() - read_seconds - init_seconds;
    let upload_start = Instant::now();
    trainer.reserve_corpus(corpus_tokens).map_err(cuda_err)?;
    let mut corpus: Vec<Option<CorpusRow>> = vec![None; data.len()];
    for chunk in chunks {
        let mut at = trainer
            .append_corpus(&chunk.aux, &chunk.last)
            .map_err(cuda_err)?;
        for (info, _, ids, mask) in chunk.rows {
            corpus[info.index] = Some(CorpusRow {
                start: at,
                input_ids: ids,
                loss_mask: mask,
            });
            at += info.len;
        }
    }
    // The upload is asynchronous: the target argmax pass after it (which ends synchronised)
    // waits for it.
    let upload_seconds = upload_start.elapsed().as_secs_f64();
    let argmax_start = Instant::now();
    trainer.finish_corpus().map_err(cuda_err)?;
    let argmax_seconds = argmax_start.elapsed().as_secs_f64();
    let total = load_start.elapsed().as_secs_f64();
    // Only once this rank's setup is over: replicas are threads of one process under
    // `--devices` tests, and a rank whose first all-reduce already spins on its GPU while
    // another still allocates and frees page-locked memory (which synchronises every device)
    // would deadlock, as XLA's and xgboost's threaded NCCL runs did. Joining is the barrier.
    let collective = match &options.data_parallel {
        None => None,
        Some(dp) => {
            let join_start = Instant::now();
            let collective =
                Collective::bootstrap(&gpu, &group_of(dp), RENDEZVOUS_TIMEOUT).map_err(cuda_err)?;
            eprintln!(
                "rank {} of {} joined NCCL on {} in {:.1}s",
                dp.rank,
                dp.world_size,
                gpu.name(),
                join_start.elapsed().as_secs_f64()
            );
            Some(collective)
        }
    };
    // The split says which part to speed up (session 23: 59.7 s for 2.55M tokens, of which
    // 40 s "GPU setup and upload" before the upload went through page-locked buffers).
    let bytes = corpus_tokens * hidden * (slots + 1) * 2;
    eprintln!(
        "loaded {} rows ({} tokens, {} train / {} validation) onto {} in {total:.1}s (read \
         {read_seconds:.1}s, head init {init_seconds:.1}s, GPU setup {setup_seconds:.1}s, \
         upload issued {upload_seconds:.1}s, upload + target argmax {argmax_seconds:.1}s: \
         {:.1} GB at {:.1} GB/s overall)",
        train_rows.len() + val_rows.len(),
        corpus_tokens,
        train_rows.len(),
        val_rows.len(),
        gpu.name(),
        bytes as f64 / 1e9,
        bytes as f64 / 1e9 / (upload_seconds + argmax_seconds).max(1e-9),
    );

    // Rank 0 logs in --out; the other replicas each in --out/rank-R (the same global numbers:
    // a check that the replicas agree).
    let log_dir = match &options.data_parallel {
        Some(dp) if !dp.is_primary() => {
            let dir = options.out.join(format!("rank-{}", dp.rank));
            std::fs::create_dir_all(&dir).map_err(TrainError::io("create", &dir))?;
            dir
        }
        _ => options.out.clone(),
    };
    let log = MetricsLog::open(&log_dir.join(METRICS_FILE), resumed_from)?;
    let mut engine = GpuEngine {
        trainer,
        collective,
        primary,
        corpus: &corpus,
        checkpoints: Checkpointing {
            options,
            config: &export_config,
            draft: &draft,
        },
    };
    run_schedule(
        Run {
            options,
            train_rows: &train_rows,
            val_rows: &val_rows,
            state,
            resumed_from,
            log,
            start,
            trained_on,
            clock: wall_clock(),
        },
        &mut engine,
    )
}

/// How long a replica waits for rank 0's NCCL id (rank 0 may still be opening the model).
const RENDEZVOUS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(900);

/// The GPU trainer's side of the run.
struct GpuEngine<'a> {
    trainer: CudaHeadTrainer,
    /// The replicas' communicator (a data-parallel run).
    collective: Option<Collective>,
    /// Whether this process writes the checkpoints and the export (rank 0, or the only one).
    primary: bool,
    corpus: &'a [Option<CorpusRow>],
    checkpoints: Checkpointing<'a>,
}

/// A replica's batch of the global `rows` (its share, padded to the global batch's width)
/// and the global batch's positions; the whole batch without replicas.
fn replica_batch<'c>(
    collective: Option<&'c Collective>,
    rows: &[usize],
    corpus: &[Option<CorpusRow>],
) -> (CorpusBatch, Option<Replicas<'c>>) {
    match collective {
        None => (corpus_batch(rows, corpus), None),
        Some(c) => {
            let width = batch_width(rows, corpus);
            let mine = replica_share(rows, c.rank(), c.world_size());
            (
                corpus_batch_padded(mine, corpus, width),
                Some(Replicas {
                    collective: c,
                    global_positions: rows.len() * width,
                }),
            )
        }
    }
}

impl StepEngine for GpuEngine<'_> {
    fn step(&mut self, rows: &[usize], lr: f64, _step: usize) -> Result<StepOutcome, TrainError> {
        let options = self.checkpoints.options;
        let hp = AdamWStep {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: options.weight_decay,
            max_grad_norm: options.max_grad_norm,
        };
        let tokens = rows.iter().map(|&i| row_len(self.corpus, i)).sum();
        let (batch, replicas) = replica_batch(self.collective.as_ref(), rows, self.corpus);
        let report = match &replicas {
            None => self.trainer.train_step(&batch, options.ttt_steps, &hp),
            Some(r) => self
                .trainer
                .train_step_replica(&batch, options.ttt_steps, &hp, r),
        }
        .map_err(cuda_err)?;
        Ok(StepOutcome {
            loss: report.loss,
            stats: to_stats(&report.steps),
            grad_norm: report.grad_norm,
            tokens,
        })
    }

    fn validate(&mut self, rows: &[RowInfo]) -> Result<StatsSum, TrainError> {
        let options = self.checkpoints.options;
        let mut sorted = rows.to_vec();
        sorted.sort_by_key(|r| (r.len, r.index));
        let mut sum = StatsSum::default();
        for chunk in sorted.chunks(options.batch_size) {
            let indices: Vec<usize> = chunk.iter().map(|r| r.index).collect();
            let tokens = chunk.iter().map(|r| row_len(self.corpus, r.index)).sum();
            let (batch, replicas) = replica_batch(self.collective.as_ref(), &indices, self.corpus);
            let counts = match &replicas {
                None => self.trainer.evaluate(&batch, options.ttt_steps),
                Some(r) => self.trainer.evaluate_replica(&batch, options.ttt_steps, r),
            }
            .map_err(cuda_err)?;
            sum.add(&to_stats(&counts), tokens);
        }
        Ok(sum)
    }

    fn any_rank(&mut self, flag: bool) -> Result<bool, TrainError> {
        match &self.collective {
            None => Ok(flag),
            Some(c) => c.any(flag).map_err(cuda_err),
        }
    }

    fn largest_over_ranks(&mut self, seconds: f64) -> Result<f64, TrainError> {
        match &self.collective {
            None => Ok(seconds),
            Some(c) => c.max(seconds).map_err(cuda_err),
        }
    }

    fn checkpoint(&mut self, state: &TrainState) -> Result<(), TrainError> {
        if !self.primary {
            return Ok(());
        }
        self.checkpoints.save(&self.trainer, state)
    }

    fn export(&mut self, dtype: WeightDtype) -> Result<(), TrainError> {
        if !self.primary {
            return Ok(());
        }
        let c = &self.checkpoints;
        Ok(save_pretrained(
            &c.head(&self.trainer)?,
            c.config,
            &c.options.out,
            dtype,
        )?)
    }
}

/// Writes GPU checkpoints: the head as an engine-loadable directory, the AdamW moments, the
/// state; the same directory layout and `latest` pointer as the burn trainer's.
struct Checkpointing<'a> {
    options: &'a TrainOptions,
    config: &'a Eagle3Config,
    draft: &'a Eagle3Draft<NdArray>,
}

impl Checkpointing<'_> {
    fn head(&self, trainer: &CudaHeadTrainer) -> Result<Eagle3Draft<NdArray>, TrainError> {
        let weights = trainer.weights().map_err(cuda_err)?;
        Ok(Eagle3Draft::<NdArray>::from_host(
            self.draft.spec.clone(),
            self.draft.vocab.clone(),
            &weights,
            self.draft.embed_tokens.clone(),
            &Default::default(),
        )?)
    }

    fn save(&self, trainer: &CudaHeadTrainer, state: &TrainState) -> Result<(), TrainError> {
        let root = self.options.out.join(CHECKPOINT_DIR);
        let name = checkpoint_name(state.step);
        let dir = root.join(&name);
        let tmp = root.join(format!(".{name}.tmp"));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(TrainError::io("clear", &tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(TrainError::io("create", &tmp))?;
        save_pretrained(
            &self.head(trainer)?,
            self.config,
            &tmp.join("head"),
            WeightDtype::F32,
        )?;
        let (m1, m2, _) = trainer.optimizer_state().map_err(cuda_err)?;
        write_adam(&tmp.join(ADAM_FILE), &m1, &m2)?;
        write_json(&tmp.join("state.json"), state)?;
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(TrainError::io("replace", &dir))?;
        }
        std::fs::rename(&tmp, &dir).map_err(TrainError::io("rename into place", &dir))?;
        prune_checkpoints(self.options, &root, &name)?;
        let lines = read_lines(&self.options.out.join(METRICS_FILE))?;
        plot::write(
            &self.options.out.join(CURVES_FILE),
            &format!("tandem train: {}", self.options.out.display()),
            &lines,
        )
    }
}

fn write_adam(path: &Path, m1: &[f32], m2: &[f32]) -> Result<(), TrainError> {
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (b1, b2) = (bytes(m1), bytes(m2));
    let views = vec![
        (
            "exp_avg",
            TensorView::new(Dtype::F32, vec![m1.len()], &b1).expect("sized"),
        ),
        (
            "exp_avg_sq",
            TensorView::new(Dtype::F32, vec![m2.len()], &b2).expect("sized"),
        ),
    ];
    safetensors::serialize_to_file(views, None, path).map_err(|e| TrainError::Gpu {
        reason: format!("cannot write {}: {e}", path.display()),
    })
}

fn read_adam(path: &Path) -> Result<(Vec<f32>, Vec<f32>), TrainError> {
    let bytes = std::fs::read(path).map_err(TrainError::io("read", path))?;
    let bad = |reason: String| TrainError::Resume {
        path: path.to_path_buf(),
        reason,
    };
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let get = |name: &str| -> Result<Vec<f32>, TrainError> {
        let t = st.tensor(name).map_err(|e| bad(format!("{name}: {e}")))?;
        Ok(t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    };
    Ok((get("exp_avg")?, get("exp_avg_sq")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-worked: rows 2 (3 tokens at corpus offset 10) and 0 (2 tokens at offset 0) padded
    /// to width 3, in the planned order.
    #[test]
    fn corpus_batches_pad_rows_in_plan_order() {
        let corpus = vec![
            Some(CorpusRow {
                start: 0,
                input_ids: vec![7, 8],
                loss_mask: vec![0, 1],
            }),
            None,
            Some(CorpusRow {
                start: 10,
                input_ids: vec![4, 5, 6],
                loss_mask: vec![1, 1, 0],
            }),
        ];
        let b = corpus_batch(&[2, 0], &corpus);
        assert_eq!(b.starts, vec![10, 0]);
        assert_eq!(b.lengths, vec![3, 2]);
        assert_eq!(b.width, 3);
        assert_eq!(b.input_ids, vec![4, 5, 6, 7, 8, 0]);
        assert_eq!(b.loss_mask, vec![1, 1, 0, 0, 1, 0]);
    }

    #[test]
    fn adam_state_round_trips_through_its_checkpoint_file() {
        let dir = tandem_model::testing::scratch_dir("adam-state");
        let path = dir.join(ADAM_FILE);
        let m1 = vec![0.5f32, -1.25, 3.0e-8];
        let m2 = vec![1.0f32, 2.0, 4.5e-12];
        write_adam(&path, &m1, &m2).unwrap();
        assert_eq!(read_adam(&path).unwrap(), (m1, m2));
        std::fs::write(&path, b"not a safetensors file").unwrap();
        let err = read_adam(&path).unwrap_err().to_string();
        assert!(err.contains(ADAM_FILE), "{err}");
    }

    #[test]
    fn bf16_staging_is_exact_for_values_read_from_a_bf16_dump() {
        let values: Vec<f32> = [1.5f32, -0.0078125, 300.0, 1.0e-3]
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let mut bits = Vec::new();
        to_bf16_bits(&values, &mut bits);
        let back: Vec<f32> = bits
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        assert_eq!(back, values);
    }
}
