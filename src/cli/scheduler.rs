//! Where a worker learns its coordinator and rank hint when its flags do not say: the
//! variables the schedulers set. Read in order: the worker's own flags and `EZERO_*`, Slurm's
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_JOB_NODELIST`), torchrun's and the PyTorchJob
//! operator's (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), then a Kubernetes Indexed
//! Job's `JOB_COMPLETION_INDEX`. The first source that gives a value is used; an explicit flag
//! that a scheduler contradicts is refused with both values, since one of them is a mistake.
//!
//! A rank from any of them is only a hint: the coordinator assigns ranks (the lowest free one
//! when the hint is taken), so a restarted pod with the same index joins as a fresh rank.

/// The port a worker dials when a scheduler names the coordinator's host but not its port
/// (Slurm): `MASTER_PORT` if set, else this, torchrun's default.
pub const DEFAULT_COORDINATOR_PORT: u16 = 29500;

/// What the worker's flags (and `EZERO_*`, which clap merges into them) say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Explicit {
    pub join: Option<String>,
    pub rank_hint: Option<u32>,
}

/// Where the worker goes, and which source said so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub join: String,
    pub rank_hint: Option<u32>,
    /// The scheduler's world size, when one gave it (the coordinator's `--ranks` decides).
    pub world: Option<u32>,
    /// For the worker's first line: `flags`, `Slurm (SLURM_PROCID, ...)`, ...
    pub source: String,
}

/// One scheduler's view, read from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Source {
    name: &'static str,
    /// The variables it read, for the worker's line and errors.
    vars: Vec<&'static str>,
    join: Option<String>,
    rank: Option<u32>,
    world: Option<u32>,
}

/// Resolves the coordinator's address and the rank hint; `env` reads a variable.
pub fn resolve(
    explicit: &Explicit,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Resolved, String> {
    let sources = [slurm(env)?, torchrun(env)?, indexed_job(env)?];
    let found: Vec<&Source> = sources.iter().flatten().collect();
    for s in &found {
        check_agrees(explicit, s)?;
    }
    let join = explicit
        .join
        .clone()
        .or_else(|| found.iter().find_map(|s| s.join.clone()))
        .ok_or_else(|| {
            "no coordinator address: pass --join HOST:PORT (or EZERO_COORDINATOR), or run under Slurm (SLURM_JOB_NODELIST) or torchrun/PyTorchJob (MASTER_ADDR, MASTER_PORT)".to_string()
        })?;
    let rank_hint = explicit
        .rank_hint
        .or_else(|| found.iter().find_map(|s| s.rank));
    let world = found.iter().find_map(|s| s.world);
    let used: Vec<String> = found
        .iter()
        .filter(|s| s.join.as_ref() == Some(&join) || (s.rank.is_some() && s.rank == rank_hint))
        .map(|s| format!("{} ({})", s.name, s.vars.join(", ")))
        .collect();
    let from_flags = explicit.join.is_some() || explicit.rank_hint.is_some();
    let source = match (from_flags, used.is_empty()) {
        (_, true) => "flags".to_string(),
        (true, false) => format!("flags and {}", used.join(" and ")),
        (false, false) => used.join(" and "),
    };
    Ok(Resolved {
        join,
        rank_hint,
        world,
        source,
    })
}

/// An explicit flag and a scheduler's value for the same thing must agree.
fn check_agrees(explicit: &Explicit, s: &Source) -> Result<(), String> {
    if let (Some(flag), Some(theirs)) = (explicit.rank_hint, s.rank) {
        if flag != theirs {
            return Err(format!(
                "--rank-hint (or EZERO_RANK_HINT) is {flag} but {} says rank {theirs} ({}): drop one of them",
                s.name,
                s.vars.join(", ")
            ));
        }
    }
    if let (Some(flag), Some(theirs)) = (&explicit.join, &s.join) {
        if flag != theirs {
            return Err(format!(
                "--join (or EZERO_COORDINATOR) is {flag} but {} names the coordinator {theirs} ({}): drop one of them",
                s.name,
                s.vars.join(", ")
            ));
        }
    }
    Ok(())
}

fn number(env: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<Option<u32>, String> {
    env(var)
        .map(|v| {
            v.trim()
                .parse::<u32>()
                .map_err(|_| format!("{var}={v:?} is not a non-negative integer"))
        })
        .transpose()
}

fn port(env: &dyn Fn(&str) -> Option<String>) -> Result<u16, String> {
    match env("MASTER_PORT") {
        Some(p) => p
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("MASTER_PORT={p:?} is not a port (1-65535)")),
        None => Ok(DEFAULT_COORDINATOR_PORT),
    }
}

/// Slurm, when `SLURM_PROCID` is set: the coordinator runs on the first host of the job's node
/// list (`MASTER_PORT`, or 29500).
fn slurm(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Source>, String> {
    let Some(rank) = number(env, "SLURM_PROCID")? else {
        return Ok(None);
    };
    let mut vars = vec!["SLURM_PROCID"];
    let world = number(env, "SLURM_NTASKS")?;
    if world.is_some() {
        vars.push("SLURM_NTASKS");
    }
    let join = match env("SLURM_JOB_NODELIST").or_else(|| env("SLURM_NODELIST")) {
        Some(list) => {
            vars.push("SLURM_JOB_NODELIST");
            let host = first_host(&list)
                .ok_or_else(|| format!("SLURM_JOB_NODELIST={list:?} names no host"))?;
            Some(format!("{host}:{}", port(env)?))
        }
        None => None,
    };
    Ok(Some(Source {
        name: "Slurm",
        vars,
        join,
        rank: Some(rank),
        world,
    }))
}

/// torchrun and the Kubeflow PyTorchJob operator, when `RANK` or `MASTER_ADDR` is set.
fn torchrun(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Source>, String> {
    let rank = number(env, "RANK")?;
    let addr = env("MASTER_ADDR").filter(|a| !a.trim().is_empty());
    if rank.is_none() && addr.is_none() {
        return Ok(None);
    }
    let mut vars = Vec::new();
    if rank.is_some() {
        vars.push("RANK");
    }
    let world = number(env, "WORLD_SIZE")?;
    if world.is_some() {
        vars.push("WORLD_SIZE");
    }
    let join = match addr {
        Some(a) => {
            vars.extend(["MASTER_ADDR", "MASTER_PORT"]);
            Some(format!("{}:{}", a.trim(), port(env)?))
        }
        None => None,
    };
    Ok(Some(Source {
        name: "torchrun",
        vars,
        join,
        rank,
        world,
    }))
}

/// A Kubernetes Indexed Job or JobSet: the pod's index is its rank hint.
fn indexed_job(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Source>, String> {
    Ok(number(env, "JOB_COMPLETION_INDEX")?.map(|index| Source {
        name: "Kubernetes",
        vars: vec!["JOB_COMPLETION_INDEX"],
        join: None,
        rank: Some(index),
        world: None,
    }))
}

/// The first host of a Slurm host list (`node[01-04,07],login1` -> `node01`): the first
/// comma-separated entry outside brackets, each bracket replaced by its first value (zero
/// padding kept).
pub fn first_host(list: &str) -> Option<String> {
    let mut depth = 0u32;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth = depth.saturating_sub(1),
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    let entry = list[..end].trim();
    let mut host = String::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        let close = open + rest[open..].find(']')?;
        host.push_str(&rest[..open]);
        let first = rest[open + 1..close].split([',', '-']).next()?.trim();
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    host.push_str(rest);
    (!host.is_empty() && !host.contains([']', '['])).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn slurm_host_lists_give_their_first_host() {
        assert_eq!(
            first_host("node[01-04,07],login1").as_deref(),
            Some("node01")
        );
        assert_eq!(first_host("gpu7").as_deref(), Some("gpu7"));
        assert_eq!(first_host("a1,b2").as_deref(), Some("a1"));
        assert_eq!(
            first_host("rack[2-3]-n[009-012]").as_deref(),
            Some("rack2-n009")
        );
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("node[01-04"), None);
    }

    #[test]
    fn slurm_alone_names_the_first_node_and_the_task_rank() {
        let env = env_of(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_JOB_NODELIST", "node[01-02]"),
        ]);
        let r = resolve(&Explicit::default(), &env).unwrap();
        assert_eq!(r.join, "node01:29500");
        assert_eq!(r.rank_hint, Some(3));
        assert_eq!(r.world, Some(4));
        assert!(r.source.starts_with("Slurm (SLURM_PROCID"), "{}", r.source);
    }

    #[test]
    fn torchrun_alone_names_master_addr_and_port() {
        let env = env_of(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "7000"),
        ]);
        let r = resolve(&Explicit::default(), &env).unwrap();
        assert_eq!((r.join.as_str(), r.rank_hint), ("10.0.0.5:7000", Some(1)));
        assert!(r.source.starts_with("torchrun"), "{}", r.source);
    }

    #[test]
    fn an_indexed_job_gives_the_rank_and_flags_the_address() {
        let env = env_of(&[("JOB_COMPLETION_INDEX", "2")]);
        let explicit = Explicit {
            join: Some("coord.ezero:29500".into()),
            rank_hint: None,
        };
        let r = resolve(&explicit, &env).unwrap();
        assert_eq!(
            (r.join.as_str(), r.rank_hint),
            ("coord.ezero:29500", Some(2))
        );
        assert!(r.source.contains("Kubernetes"), "{}", r.source);
    }

    #[test]
    fn flags_win_only_where_no_scheduler_disagrees() {
        let env = env_of(&[("SLURM_PROCID", "1"), ("SLURM_JOB_NODELIST", "n1")]);
        let explicit = Explicit {
            join: None,
            rank_hint: Some(2),
        };
        let e = resolve(&explicit, &env).unwrap_err();
        assert!(e.contains("is 2") && e.contains("rank 1"), "{e}");
        let explicit = Explicit {
            join: Some("other:1".into()),
            rank_hint: None,
        };
        let e = resolve(&explicit, &env).unwrap_err();
        assert!(e.contains("other:1") && e.contains("n1:29500"), "{e}");
        let same = Explicit {
            join: Some("n1:29500".into()),
            rank_hint: Some(1),
        };
        assert_eq!(resolve(&same, &env).unwrap().rank_hint, Some(1));
    }

    #[test]
    fn nothing_to_go_on_or_bad_values_say_what_to_set() {
        let e = resolve(&Explicit::default(), &env_of(&[])).unwrap_err();
        assert!(e.contains("--join") && e.contains("MASTER_ADDR"), "{e}");
        let e = resolve(&Explicit::default(), &env_of(&[("RANK", "x")])).unwrap_err();
        assert!(e.contains("RANK=\"x\""), "{e}");
        let bad_port = env_of(&[("MASTER_ADDR", "h"), ("MASTER_PORT", "0")]);
        let e = resolve(&Explicit::default(), &bad_port).unwrap_err();
        assert!(e.contains("MASTER_PORT"), "{e}");
    }
}
