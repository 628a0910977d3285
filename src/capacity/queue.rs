//! The fair queue of requests waiting for an upstream slot: round robin across identities
//! within a priority class, weighted turns across the classes.
//!
//! Deficit round robin with every request costing one (a request's cost to the backend is not
//! known before it runs) is plain round robin over the identities with requests waiting: each
//! identity in turn gives up its oldest request, so an identity with one request waits at most
//! one turn of every other waiting identity, however many the heaviest has queued.

use std::collections::{HashMap, VecDeque};

/// A route's class in the queue. Under contention the classes are served in turns of
/// `SHARES` (high, normal, low): the lower classes slow down but are never starved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// Requests each class gets per turn when all three have some waiting.
pub const SHARES: [u32; 3] = [8, 4, 1];

/// One waiting request: its number (to leave the queue by), the client address it came from
/// (`peer_key`), and whatever the owner of the queue hands it when its turn comes.
#[derive(Debug)]
pub(super) struct Waiter<T> {
    pub id: u64,
    pub peer: u64,
    pub item: T,
}

/// One class: identities with requests waiting, in turn order, and their requests.
#[derive(Debug)]
struct Class<T> {
    turns: VecDeque<u128>,
    waiting: HashMap<u128, VecDeque<Waiter<T>>>,
}

impl<T> Default for Class<T> {
    fn default() -> Self {
        Self {
            turns: VecDeque::new(),
            waiting: HashMap::new(),
        }
    }
}

/// Waiting requests by class and identity.
#[derive(Debug)]
pub(super) struct FairQueue<T> {
    classes: [Class<T>; 3],
    /// The class whose turn it is, and what it has left of its share.
    class: usize,
    left: u32,
    len: usize,
}

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        Self {
            classes: Default::default(),
            class: 0,
            left: SHARES[0],
            len: 0,
        }
    }
}

impl<T> FairQueue<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Requests waiting in each class, in `Priority::ALL` order.
    pub fn by_class(&self) -> [usize; 3] {
        self.classes
            .each_ref()
            .map(|c| c.waiting.values().map(VecDeque::len).sum())
    }

    /// Identities with requests waiting.
    pub fn identities(&self) -> usize {
        self.classes.iter().map(|c| c.turns.len()).sum()
    }

    pub fn push(&mut self, class: Priority, key: u128, waiter: Waiter<T>) {
        let c = &mut self.classes[class as usize];
        let queue = c.waiting.entry(key).or_default();
        if queue.is_empty() {
            c.turns.push_back(key);
        }
        queue.push_back(waiter);
        self.len += 1;
    }

    /// Take request `id` of `key` out of the queue (its client left, or it timed out); `None`
    /// when it is no longer there (its turn came).
    pub fn remove(&mut self, class: Priority, key: u128, id: u64) -> Option<Waiter<T>> {
        let ci = class as usize;
        let at = self.classes[ci]
            .waiting
            .get(&key)?
            .iter()
            .position(|w| w.id == id)?;
        self.take(ci, key, at)
    }

    /// Requests `key` has waiting in `class`.
    pub fn waiting(&self, class: Priority, key: u128) -> usize {
        self.classes[class as usize]
            .waiting
            .get(&key)
            .map_or(0, VecDeque::len)
    }

    /// Make room in a full queue for a request of `class`, identity `key`, from client address
    /// `peer`: the newest request of the address with the most waiting, if that is more than
    /// the newcomer's address has plus one (so one address cannot fill the queue, however many
    /// identities it mints); else the newest of the identity with the most waiting, on the
    /// same terms. Only requests of the newcomer's class or a lower one give way, the lowest
    /// first: a higher priority is never pushed out by a lower one.
    pub fn push_out(&mut self, class: Priority, key: u128, peer: u64) -> Option<Waiter<T>> {
        let eligible = class as usize..self.classes.len();
        let mut by_peer: HashMap<u64, usize> = HashMap::new();
        for c in &self.classes {
            for w in c.waiting.values().flatten() {
                *by_peer.entry(w.peer).or_default() += 1;
            }
        }
        let have_peer = by_peer.get(&peer).copied().unwrap_or(0);
        let have_key = self.waiting(class, key);
        // Per (class, identity): its requests waiting, and those of the heaviest address.
        let mut heaviest_peer: Option<(usize, u64)> = None;
        let mut heaviest_key: Option<(usize, usize, u128)> = None;
        for ci in eligible.clone().rev() {
            for (k, q) in &self.classes[ci].waiting {
                if heaviest_key.is_none_or(|(n, _, _)| q.len() > n) {
                    heaviest_key = Some((q.len(), ci, *k));
                }
                for w in q {
                    let n = by_peer[&w.peer];
                    if heaviest_peer.is_none_or(|(m, _)| n > m) {
                        heaviest_peer = Some((n, w.peer));
                    }
                }
            }
        }
        if let Some((_, heavy)) = heaviest_peer.filter(|(n, _)| *n > have_peer + 1) {
            // That address's newest request, in the lowest class it has one in.
            for ci in eligible.rev() {
                let newest = self.classes[ci]
                    .waiting
                    .iter()
                    .filter_map(|(k, q)| {
                        let at = q.iter().rposition(|w| w.peer == heavy)?;
                        Some((q[at].id, *k, at))
                    })
                    .max_by_key(|(id, _, _)| *id);
                if let Some((_, k, at)) = newest {
                    return self.take(ci, k, at);
                }
            }
        }
        let (n, ci, k) = heaviest_key?;
        if n <= have_key + 1 {
            return None;
        }
        let at = self.classes[ci].waiting.get(&k)?.len().checked_sub(1)?;
        self.take(ci, k, at)
    }

    /// Take the request at `at` in identity `key`'s line of class `ci`.
    fn take(&mut self, ci: usize, key: u128, at: usize) -> Option<Waiter<T>> {
        let c = &mut self.classes[ci];
        let queue = c.waiting.get_mut(&key)?;
        let waiter = queue.remove(at);
        if queue.is_empty() {
            c.waiting.remove(&key);
            c.turns.retain(|k| *k != key);
        }
        self.len -= 1;
        waiter
    }

    /// The next request whose turn it is.
    pub fn pop(&mut self) -> Option<Waiter<T>> {
        if self.len == 0 {
            return None;
        }
        // A class with nothing waiting, or its share used up, passes the turn on.
        while self.left == 0 || self.classes[self.class].turns.is_empty() {
            self.class = (self.class + 1) % SHARES.len();
            self.left = SHARES[self.class];
        }
        self.left -= 1;
        let c = &mut self.classes[self.class];
        let key = c.turns.pop_front()?;
        let queue = c.waiting.get_mut(&key)?;
        let waiter = queue.pop_front();
        if queue.is_empty() {
            c.waiting.remove(&key);
        } else {
            c.turns.push_back(key);
        }
        self.len -= 1;
        waiter
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(q: &mut FairQueue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| q.pop().map(|w| w.item)).collect()
    }

    #[test]
    fn identities_take_turns_whatever_one_has_queued() {
        let mut q = FairQueue::default();
        for id in 0..1000 {
            q.push(
                Priority::Normal,
                1,
                Waiter {
                    id,
                    peer: 1,
                    item: "heavy",
                },
            );
        }
        q.push(
            Priority::Normal,
            2,
            Waiter {
                id: 1000,
                peer: 2,
                item: "light",
            },
        );
        q.push(
            Priority::Normal,
            3,
            Waiter {
                id: 1001,
                peer: 3,
                item: "other",
            },
        );
        let served = order(&mut q);
        // The light identities' only requests come within the first turn.
        assert_eq!(&served[..3], ["heavy", "light", "other"]);
        assert_eq!(served.len(), 1002);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn a_full_queue_pushes_out_the_heaviest_identity_newest_request() {
        let mut q = FairQueue::default();
        for id in 0..4 {
            q.push(
                Priority::Normal,
                1,
                Waiter {
                    id,
                    peer: 1,
                    item: "heavy",
                },
            );
        }
        q.push(
            Priority::Normal,
            2,
            Waiter {
                id: 4,
                peer: 2,
                item: "light",
            },
        );
        assert_eq!(q.push_out(Priority::Normal, 3, 3).map(|w| w.id), Some(3));
        assert_eq!(q.waiting(Priority::Normal, 1), 3);
        // An address as heavy as the heaviest pushes nothing out.
        for id in 5..7 {
            q.push(
                Priority::Normal,
                9,
                Waiter {
                    id,
                    peer: 2,
                    item: "light",
                },
            );
        }
        assert!(q.push_out(Priority::Normal, 9, 2).is_none());
    }

    #[test]
    fn one_address_minting_identities_is_pushed_out_as_one() {
        let mut q = FairQueue::default();
        // Eight identities from one address, one request each.
        for id in 0..8 {
            let key = u128::from(id);
            q.push(
                Priority::Normal,
                key,
                Waiter {
                    id,
                    peer: 1,
                    item: "minted",
                },
            );
        }
        let out = q.push_out(Priority::Normal, 100, 2).expect("room made");
        assert_eq!((out.id, out.peer), (7, 1), "the address's newest request");
    }

    #[test]
    fn a_lower_class_never_pushes_out_a_higher_one() {
        let mut q = FairQueue::default();
        for id in 0..6 {
            q.push(
                Priority::High,
                1,
                Waiter {
                    id,
                    peer: 1,
                    item: "high",
                },
            );
        }
        assert!(q.push_out(Priority::Low, 2, 2).is_none());
        assert!(q.push_out(Priority::Normal, 2, 2).is_none());
        q.push(
            Priority::Low,
            3,
            Waiter {
                id: 6,
                peer: 1,
                item: "low",
            },
        );
        // The heavy address gives its low request first, to a high newcomer.
        let out = q.push_out(Priority::High, 2, 2).expect("room made");
        assert_eq!(out.item, "low");
        assert_eq!(
            q.push_out(Priority::High, 2, 2).map(|w| w.item),
            Some("high")
        );
    }

    #[test]
    fn a_request_leaves_the_queue_by_its_number() {
        let mut q = FairQueue::default();
        q.push(
            Priority::Low,
            7,
            Waiter {
                id: 1,
                peer: 1,
                item: "a",
            },
        );
        q.push(
            Priority::Low,
            7,
            Waiter {
                id: 2,
                peer: 1,
                item: "b",
            },
        );
        assert_eq!(q.remove(Priority::Low, 7, 1).map(|w| w.item), Some("a"));
        assert!(q.remove(Priority::Low, 7, 1).is_none());
        assert_eq!(q.remove(Priority::Low, 7, 2).map(|w| w.item), Some("b"));
        assert_eq!((q.len(), q.identities()), (0, 0));
        assert!(q.pop().is_none());
    }

    #[test]
    fn classes_share_turns_and_low_is_never_starved() {
        let mut q = FairQueue::default();
        let mut id = 0u64;
        for (class, item) in [
            (Priority::High, "h"),
            (Priority::Normal, "n"),
            (Priority::Low, "l"),
        ] {
            for _ in 0..100 {
                id += 1;
                q.push(class, u128::from(id), Waiter { id, peer: id, item });
            }
        }
        let served = order(&mut q);
        let first: String = served[..26].concat();
        assert_eq!(first, "hhhhhhhhnnnnlhhhhhhhhnnnnl");
        // Alone in the queue, a class takes every turn.
        assert!(served[served.len() - 20..].iter().all(|s| *s == "l"));
    }
}
