//! The cluster examples run or are checked here: `examples/slurm/ezero.sbatch` runs on this
//! machine under stand-ins for `srun` and `scontrol` that set what Slurm sets, and the
//! Kubernetes manifests are parsed and checked for what the workers and the coordinator read
//! (their arguments go through the real `ezero` argument parser).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::procs::{digest, flags_with, reference_digest, run, secrets, EZERO};

fn example(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples")
        .join(path)
}

/// `srun`: runs the command once per task (`--ntasks=N`, else SLURM_NTASKS) with SLURM_PROCID
/// set, and waits. `scontrol show hostnames LIST`: the list's entries, one per line.
fn slurm_stand_ins(dir: &Path) {
    let srun = r#"#!/bin/bash
n=$SLURM_NTASKS
while [[ $1 == --* ]]; do
  case $1 in --ntasks=*) n=${1#--ntasks=} ;; esac
  shift
done
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i "$@" & done
wait
"#;
    let scontrol = "#!/bin/bash\n[ \"$1 $2\" = 'show hostnames' ] && echo \"$3\" | tr ',' '\\n'\n";
    for (name, text) in [("srun", srun), ("scontrol", scontrol)] {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        let mut perm = std::fs::metadata(&p).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
        std::fs::set_permissions(&p, perm).unwrap();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// The sbatch script, as Slurm would run it on a two-task allocation of one node: the
/// coordinator on the first node, two workers that find it and their ranks in Slurm's
/// variables, and the in-process run's digest.
#[test]
fn the_slurm_example_trains_under_slurms_variables() {
    let flags = flags_with("mlp", 2, 3, &[]);
    let reference = reference_digest(2, &flags);
    let bin = tempfile::tempdir().unwrap();
    slurm_stand_ins(bin.path());
    let dir = secrets();
    let token = dir.path().join("cluster-token");
    std::fs::write(&token, "test-token-slurm\n").unwrap();
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap()
    );
    let mut cmd = Command::new("bash");
    cmd.arg(example("slurm/ezero.sbatch"))
        .env("PATH", path)
        .env("EZERO", EZERO)
        .env("EZERO_SECRETS_DIR", dir.path())
        .env("EZERO_CLUSTER_TOKEN_FILE", &token)
        .env("EZERO_TRAIN_FLAGS", flags.join(" "))
        .env("MASTER_PORT", free_port().to_string())
        .env("SLURM_JOB_NODELIST", "127.0.0.1")
        .env("SLURM_NTASKS", "2")
        .env("SLURM_JOB_ID", "1");
    for var in [
        "RANK",
        "MASTER_ADDR",
        "JOB_COMPLETION_INDEX",
        "EZERO_RANK_HINT",
    ] {
        cmd.env_remove(var);
    }
    let (code, out, err) = run(&mut cmd);
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(digest(&out).as_deref(), Some(reference.as_str()), "{out}");
    for rank in 0..2 {
        assert!(
            out.contains(&format!("rank hint {rank}, from Slurm (SLURM_PROCID")),
            "{out}"
        );
    }
}

fn documents() -> Vec<serde_yaml::Value> {
    let text = std::fs::read_to_string(example("kubernetes/ezero.yaml")).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("each document parses"))
        .collect()
}

fn of_kind<'a>(docs: &'a [serde_yaml::Value], kind: &str) -> &'a serde_yaml::Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("a {kind}"))
}

fn strings(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

/// `ezero ARGS --help`: every flag of the manifest is one `ezero` knows, with a valid value.
fn assert_args_parse(args: &[String]) {
    let (code, _, err) = run(Command::new(EZERO).args(args).arg("--help"));
    assert_eq!(code, 0, "{args:?}: {err}");
}

/// An env var's value in `container`, and the secret volume mounted above the path it names.
fn secret_file(pod: &serde_yaml::Value, container: &serde_yaml::Value, var: &str) -> String {
    let env = container["env"].as_sequence().unwrap();
    let value = env
        .iter()
        .find(|e| e["name"] == var)
        .and_then(|e| e["value"].as_str())
        .unwrap_or_else(|| panic!("{var} is set"))
        .to_string();
    let mounts = container["volumeMounts"].as_sequence().unwrap();
    let mount = mounts
        .iter()
        .find(|m| value.starts_with(m["mountPath"].as_str().unwrap()))
        .unwrap_or_else(|| panic!("{var}={value} is under a mount"));
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mount's volume");
    assert!(
        volume["secret"]["secretName"].is_string(),
        "{var}: {volume:?}"
    );
    value
}

/// The manifests: workers in an Indexed Job (JOB_COMPLETION_INDEX), behind a headless
/// Service, with a grace longer than their drain grace, the cluster's secrets and the operator
/// token from Secrets, and arguments `ezero` accepts.
#[test]
fn the_kubernetes_example_gives_the_workers_what_they_read() {
    let docs = documents();
    let job = of_kind(&docs, "Job");
    assert_eq!(job["spec"]["completionMode"], "Indexed");
    let pod = &job["spec"]["template"]["spec"];
    let worker = &pod["containers"][0];
    let args = strings(&worker["args"]);
    assert_eq!(args[0], "worker");
    assert_args_parse(&args);
    let grace_s: f64 = args
        .iter()
        .find_map(|a| a.strip_prefix("--drain-grace-s="))
        .expect("--drain-grace-s")
        .parse()
        .unwrap();
    let pod_grace = pod["terminationGracePeriodSeconds"].as_f64().unwrap();
    assert!(
        grace_s < pod_grace,
        "drain grace {grace_s} >= pod grace {pod_grace}"
    );
    secret_file(pod, worker, "EZERO_SECRETS_DIR");
    secret_file(pod, worker, "EZERO_CLUSTER_TOKEN_FILE");
    let headless = docs
        .iter()
        .find(|d| d["kind"] == "Service" && d["spec"]["clusterIP"] == "None")
        .expect("a headless Service");
    assert_eq!(pod["subdomain"], headless["metadata"]["name"]);
    assert_eq!(
        headless["spec"]["selector"],
        job["spec"]["template"]["metadata"]["labels"]
    );

    let coord = of_kind(&docs, "StatefulSet");
    let pod = &coord["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args = strings(&c["args"]);
    assert_eq!(args[0], "coordinator");
    assert_args_parse(&args);
    assert!(
        args.iter().any(|a| a.starts_with("--control=0.0.0.0:")),
        "{args:?}"
    );
    secret_file(pod, c, "EZERO_CONTROL_TOKEN_FILE");
    secret_file(pod, c, "EZERO_CLUSTER_TOKEN_FILE");
}
