//! Evaluation prompt sets, read strictly: any bad record is an error, because a silently
//! missing prompt would change the benchmark.

use std::collections::HashSet;
use std::path::Path;

use crate::reader::{detect_format, read_jsonl_strict, resolve};
use crate::{DataError, EvalPrompt, Format, SkipReason};

/// Errors on duplicate ids: results are keyed by id.
fn check_unique(path: &Path, prompts: &[EvalPrompt]) -> Result<(), DataError> {
    let mut seen = HashSet::new();
    for p in prompts {
        if !seen.insert(p.id.as_str()) {
            return Err(DataError::format(path, format!("duplicate id {:?}", p.id)));
        }
    }
    Ok(())
}

/// MT-Bench questions (`question.jsonl`) with all their turns, in file order.
pub fn mtbench_prompts(path: &Path) -> Result<Vec<EvalPrompt>, DataError> {
    let prompts = read_jsonl_strict(path, |text| {
        let (id, category, turns) = crate::record::decode_mtbench_full(text)?;
        if turns.is_empty() {
            return Err((SkipReason::EmptyConversation, "no turns".into()));
        }
        if let Some(i) = turns.iter().position(|t| t.trim().is_empty()) {
            return Err((SkipReason::EmptyMessage, format!("turn {} is empty", i + 1)));
        }
        Ok(EvalPrompt {
            id,
            category,
            turns,
        })
    })?;
    check_unique(path, &prompts)?;
    Ok(prompts)
}

/// HumanEval tasks (`HumanEval.jsonl.gz`, or uncompressed), one turn each: the code prompt,
/// verbatim. Category `humaneval`.
pub fn humaneval_prompts(path: &Path) -> Result<Vec<EvalPrompt>, DataError> {
    let prompts = read_jsonl_strict(path, |text| {
        let (id, prompt) = crate::record::decode_humaneval_full(text)?;
        if prompt.trim().is_empty() {
            return Err((SkipReason::EmptyMessage, "empty prompt".into()));
        }
        Ok(EvalPrompt {
            id,
            category: "humaneval".into(),
            turns: vec![prompt],
        })
    })?;
    check_unique(path, &prompts)?;
    Ok(prompts)
}

/// Evaluation prompts by spec: a registry name (`mtbench`, `humaneval`) or a local MT-Bench /
/// HumanEval file (format detected). Chat datasets are refused: they are not prompt sets.
pub fn eval_prompts(spec: &str, data_root: &Path) -> Result<Vec<EvalPrompt>, DataError> {
    let (entry, path) = resolve(spec, data_root)?;
    let format = match entry {
        Some(e) => e.format,
        None => detect_format(&path)?,
    };
    match format {
        Format::MtBenchJsonl => mtbench_prompts(&path),
        Format::HumanEvalJsonl => humaneval_prompts(&path),
        f => Err(DataError::format(
            &path,
            format!("{f} is not an evaluation prompt format (mtbench-jsonl, humaneval-jsonl)"),
        )),
    }
}
