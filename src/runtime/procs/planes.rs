//! Which data plane each pair of worker processes uses.
//!
//! Under `--transport ucx` every worker binds TLS TCP and, beside it, a UCX worker limited to
//! shared-memory transports, and reports both over its control connection. The coordinator
//! picks UCX for a pair only when it has confirmed that the two share a host and a user: both
//! report the same host identity (boot id and IPC, mount and PID namespaces, which shared
//! memory and CMA need in common) and user id, and both control connections came from the same
//! IP address. With `--ucx-net` (network devices the operator declares trusted), pairs on
//! different hosts use UCX over those devices too, unencrypted. Every other pair uses TCP.
//! UCX addresses travel only over the mutual-TLS control connections, so an address from a
//! process that did not pass the handshake is never used.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;

use super::control_plane::{DataPeer, DataPlane, UcxBound};
use crate::plan::RankId;
use crate::runtime::api::control::DataPlanes;
use crate::runtime::api::status::PlanePair;

/// What the coordinator knows of one worker's data plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub data_addr: String,
    pub ucx: Option<UcxBound>,
    /// Where its control connection came from.
    pub control_ip: IpAddr,
}

/// How a pair of workers talks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pair {
    /// UCX shared memory: confirmed on one host, as one user.
    UcxShm,
    /// UCX over the network devices the operator declared trusted (`--ucx-net`), unencrypted.
    UcxNet,
    /// The job's TLS plane (TCP or QUIC).
    Tls,
}

/// How `a` and `b` talk.
pub fn pair(a: &Endpoint, b: &Endpoint) -> Pair {
    match (&a.ucx, &b.ucx) {
        (Some(x), Some(y))
            if x.host == y.host && x.uid == y.uid && a.control_ip == b.control_ip =>
        {
            Pair::UcxShm
        }
        (Some(x), Some(y)) if x.net && y.net => Pair::UcxNet,
        _ => Pair::Tls,
    }
}

/// Whether `a` and `b` talk over UCX.
pub fn ucx_pair(a: &Endpoint, b: &Endpoint) -> bool {
    pair(a, b) != Pair::Tls
}

/// `peer` (rank `rank`) as the worker at `me` is told of it.
pub fn peer_entry(me: &Endpoint, rank: RankId, peer: &Endpoint) -> DataPeer {
    DataPeer {
        rank,
        data_addr: peer.data_addr.clone(),
        ucx: ucx_pair(me, peer)
            .then(|| peer.ucx.as_ref().map(|u| u.address.clone()))
            .flatten(),
    }
}

/// This process's host as far as shared memory is concerned: processes that report the same
/// string can map each other's segments and read each other's memory (same kernel boot, same
/// IPC, mount and PID namespaces).
pub fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = |n: &str| {
        std::fs::read_link(format!("/proc/self/ns/{n}"))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    format!("{} {} {} {}", boot.trim(), ns("ipc"), ns("mnt"), ns("pid"))
}

/// The effective user id.
pub fn user_id() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Every worker's endpoint, as the coordinator holds them for the run (joiners added).
pub struct Endpoints {
    plane: DataPlane,
    map: Mutex<BTreeMap<RankId, Endpoint>>,
}

impl Endpoints {
    pub fn new(plane: DataPlane) -> Self {
        Self {
            plane,
            map: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<RankId, Endpoint>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What worker `rank` reported in its `Bound`, from `control_ip`; its UCX side is kept
    /// only when the job runs the UCX plane.
    pub fn record(
        &self,
        rank: RankId,
        data_addr: String,
        ucx: Option<UcxBound>,
        control_ip: IpAddr,
    ) {
        let ucx = ucx.filter(|_| self.plane == DataPlane::Ucx);
        self.insert(
            rank,
            Endpoint {
                data_addr,
                ucx,
                control_ip,
            },
        );
    }

    fn insert(&self, rank: RankId, e: Endpoint) {
        self.lock().insert(rank, e);
    }

    /// How many of `ranks` connected from `ip`.
    pub fn count_from(&self, ip: IpAddr, ranks: &[RankId]) -> usize {
        let map = self.lock();
        ranks
            .iter()
            .filter(|r| map.get(r).is_some_and(|e| e.control_ip == ip))
            .count()
    }

    /// The peer list for `me`: each of `ranks` with a known endpoint, UCX where the pair
    /// qualifies.
    pub fn peers_for(&self, me: RankId, ranks: impl IntoIterator<Item = RankId>) -> Vec<DataPeer> {
        let map = self.lock();
        let Some(mine) = map.get(&me) else {
            return Vec::new();
        };
        ranks
            .into_iter()
            .filter_map(|r| map.get(&r).map(|e| peer_entry(mine, r, e)))
            .collect()
    }
}

impl DataPlanes for Endpoints {
    fn pairs(&self, members: &[RankId]) -> Vec<PlanePair> {
        let map = self.lock();
        let mut out = Vec::new();
        for (i, a) in members.iter().enumerate() {
            for b in &members[i + 1..] {
                let (Some(x), Some(y)) = (map.get(a), map.get(b)) else {
                    continue;
                };
                let plane = match pair(x, y) {
                    Pair::UcxShm => "ucx",
                    Pair::UcxNet => "ucx-net",
                    // The TCP beside UCX.
                    Pair::Tls if self.plane == DataPlane::Ucx => "tcp",
                    Pair::Tls => self.plane.name(),
                };
                out.push(PlanePair {
                    ranks: [*a, *b],
                    plane: plane.into(),
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(host: &str, uid: u32, ip: [u8; 4], ucx: bool) -> Endpoint {
        Endpoint {
            data_addr: format!("{}.{}.{}.{}:9000", ip[0], ip[1], ip[2], ip[3]),
            ucx: ucx.then(|| UcxBound {
                address: host.as_bytes().to_vec(),
                host: host.into(),
                uid,
                net: false,
            }),
            control_ip: IpAddr::from(ip),
        }
    }

    #[test]
    fn ucx_only_between_workers_confirmed_on_one_host_as_one_user() {
        let a = ep("h1", 1000, [10, 0, 0, 1], true);
        assert!(ucx_pair(&a, &ep("h1", 1000, [10, 0, 0, 1], true)));
        // Another host, another user, another source address, or no UCX on one side.
        assert!(!ucx_pair(&a, &ep("h2", 1000, [10, 0, 0, 1], true)));
        assert!(!ucx_pair(&a, &ep("h1", 0, [10, 0, 0, 1], true)));
        assert!(!ucx_pair(&a, &ep("h1", 1000, [10, 0, 0, 2], true)));
        assert!(!ucx_pair(&a, &ep("h1", 1000, [10, 0, 0, 1], false)));
        // Across hosts only when both declared a trusted network.
        let net = |mut e: Endpoint| {
            e.ucx.as_mut().unwrap().net = true;
            e
        };
        let (x, y) = (
            ep("h1", 1, [10, 0, 0, 1], true),
            ep("h2", 1, [10, 0, 0, 2], true),
        );
        assert_eq!(pair(&net(x.clone()), &net(y.clone())), Pair::UcxNet);
        assert_eq!(pair(&net(x.clone()), &y), Pair::Tls);
        assert_eq!(pair(&net(x.clone()), &net(x)), Pair::UcxShm);
    }

    #[test]
    fn each_worker_gets_ucx_addresses_only_for_its_pairs_and_status_lists_every_pair() {
        let e = Endpoints::new(DataPlane::Ucx);
        e.insert(0, ep("h1", 1, [10, 0, 0, 1], true));
        e.insert(1, ep("h1", 1, [10, 0, 0, 1], true));
        e.insert(2, ep("h2", 1, [10, 0, 0, 2], true));
        let for0 = e.peers_for(0, [1, 2]);
        assert_eq!(for0[0].ucx.as_deref(), Some(&b"h1"[..]));
        assert_eq!((for0[1].rank, for0[1].ucx.as_ref()), (2, None));
        assert_eq!(for0[1].data_addr, "10.0.0.2:9000");
        assert!(e.peers_for(2, [0, 1]).iter().all(|p| p.ucx.is_none()));
        let planes: Vec<(RankId, RankId, String)> = e
            .pairs(&[0, 1, 2])
            .into_iter()
            .map(|p| (p.ranks[0], p.ranks[1], p.plane))
            .collect();
        assert_eq!(
            planes,
            vec![
                (0, 1, "ucx".into()),
                (0, 2, "tcp".into()),
                (1, 2, "tcp".into())
            ]
        );
    }

    /// A joiner's share of its host's cores counts the members that connected from its
    /// address, whatever their data plane.
    #[test]
    fn ranks_are_counted_by_the_address_they_connected_from() {
        let e = Endpoints::new(DataPlane::Tcp);
        e.insert(0, ep("h1", 1, [10, 0, 0, 1], false));
        e.insert(1, ep("h1", 1, [10, 0, 0, 1], false));
        e.insert(2, ep("h2", 1, [10, 0, 0, 2], false));
        let one = IpAddr::from([10, 0, 0, 1]);
        assert_eq!(e.count_from(one, &[0, 1, 2]), 2);
        assert_eq!(
            e.count_from(one, &[1, 2, 7]),
            1,
            "unknown ranks do not count"
        );
        assert_eq!(e.count_from(IpAddr::from([10, 0, 0, 3]), &[0, 1, 2]), 0);
    }

    #[test]
    fn this_process_has_a_host_identity() {
        let h = host_identity();
        assert!(h.contains("ipc:["), "{h}");
        assert_eq!(h, host_identity());
    }
}
