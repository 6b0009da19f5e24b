//! `--meta`: which store a job's coordinators share, parsed once.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// What `--meta` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaUrl {
    /// One process: the coordinator's memory.
    Memory,
    /// One host: a directory (`file:DIR`).
    Dir(PathBuf),
    /// An etcd cluster (`etcd://HOST:PORT[,HOST:PORT...]`); each endpoint as `http://HOST:PORT`.
    Etcd { endpoints: Vec<String> },
    /// A throwaway etcd started from PATH on loopback (`etcd-local`).
    EtcdLocal,
}

/// The accepted forms, for every parse error.
pub const META_FORMS: &str = "memory, file:DIR, etcd://HOST:PORT[,HOST:PORT...] or etcd-local";

/// A `--meta` value that names no store: which part is wrong, and the accepted forms.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--meta {value:?}: {detail}; accepted: {META_FORMS}")]
pub struct MetaUrlError {
    pub value: String,
    pub detail: String,
}

impl FromStr for MetaUrl {
    type Err = MetaUrlError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |detail: String| MetaUrlError {
            value: s.to_string(),
            detail,
        };
        match s {
            "memory" => return Ok(Self::Memory),
            "etcd-local" => return Ok(Self::EtcdLocal),
            _ => {}
        }
        if let Some(dir) = s.strip_prefix("file:") {
            let dir = dir.strip_prefix("//").unwrap_or(dir);
            if dir.is_empty() {
                return Err(err("file: needs a directory after it".into()));
            }
            return Ok(Self::Dir(PathBuf::from(dir)));
        }
        if let Some(list) = s.strip_prefix("etcd://") {
            let endpoints = list
                .split(',')
                .map(endpoint)
                .collect::<Result<Vec<_>, _>>()
                .map_err(err)?;
            return Ok(Self::Etcd { endpoints });
        }
        Err(err("unknown kind of store".into()))
    }
}

/// One `HOST:PORT` of an etcd list, as the URL the client dials.
fn endpoint(part: &str) -> Result<String, String> {
    let part = part.trim();
    if part.is_empty() {
        return Err("an empty endpoint in the etcd list".into());
    }
    let Some((host, port)) = part.rsplit_once(':') else {
        return Err(format!("endpoint {part:?} has no :PORT"));
    };
    let bracketed = host.starts_with('[') && host.ends_with(']');
    if host.is_empty() || host.contains('/') || (host.contains(':') && !bracketed) {
        return Err(format!("endpoint {part:?} has a bad host {host:?}"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(format!("http://{host}:{p}")),
        _ => Err(format!(
            "endpoint {part:?} has a bad port {port:?} (1-65535)"
        )),
    }
}

impl fmt::Display for MetaUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Memory => write!(f, "memory"),
            Self::Dir(d) => write!(f, "file:{}", d.display()),
            Self::EtcdLocal => write!(f, "etcd-local"),
            Self::Etcd { endpoints } => {
                let bare: Vec<&str> = endpoints
                    .iter()
                    .map(|e| e.strip_prefix("http://").unwrap_or(e))
                    .collect();
                write!(f, "etcd://{}", bare.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<MetaUrl, String> {
        s.parse::<MetaUrl>().map_err(|e| e.to_string())
    }

    #[test]
    fn good_urls_parse_and_print_back() {
        assert_eq!(parse("memory"), Ok(MetaUrl::Memory));
        assert_eq!(parse("etcd-local"), Ok(MetaUrl::EtcdLocal));
        assert_eq!(parse("file:/var/ez"), Ok(MetaUrl::Dir("/var/ez".into())));
        assert_eq!(parse("file:rel/dir"), Ok(MetaUrl::Dir("rel/dir".into())));
        assert_eq!(parse("file:///abs"), Ok(MetaUrl::Dir("/abs".into())));
        let etcd = parse("etcd://10.0.0.1:2379,host-b:2380,[::1]:2379").unwrap();
        let want = [
            "http://10.0.0.1:2379",
            "http://host-b:2380",
            "http://[::1]:2379",
        ];
        assert_eq!(
            etcd,
            MetaUrl::Etcd {
                endpoints: want.iter().map(|s| s.to_string()).collect()
            }
        );
        for s in ["memory", "etcd-local", "file:/var/ez", "etcd://a:1,b:2"] {
            assert_eq!(parse(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn bad_urls_name_the_bad_part_and_the_forms() {
        let cases = [
            ("", "unknown kind of store"),
            ("mem", "unknown kind of store"),
            ("file:", "file: needs a directory"),
            ("etcd://", "an empty endpoint"),
            ("etcd://a:1,,b:2", "an empty endpoint"),
            ("etcd://host", "endpoint \"host\" has no :PORT"),
            ("etcd://host:x", "bad port \"x\""),
            ("etcd://host:0", "bad port \"0\""),
            ("etcd://host:70000", "bad port \"70000\""),
            ("etcd://:2379", "bad host \"\""),
            ("etcd://a/b:1", "bad host \"a/b\""),
            ("etcd://::1:2379", "bad host \"::1\""),
        ];
        for (value, part) in cases {
            let msg = parse(value).unwrap_err();
            assert!(msg.contains(part), "{value:?}: {msg}");
            assert!(msg.contains(META_FORMS), "{value:?}: {msg}");
            assert!(msg.starts_with(&format!("--meta {value:?}")), "{msg}");
            assert!(!msg.contains('\n'), "{msg}");
        }
    }
}
