//! The gate with tokio's paused clock: caps, the queue's bounds, leaving it, fairness.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;

use super::*;

fn handles() -> Handles {
    Handles {
        wait: Histogram::new([0.1]),
        refused: Default::default(),
    }
}

fn gate(cap: usize, size: usize, targets: usize) -> Arc<Gate> {
    let spec = Spec {
        cap: Cap::Fixed(cap),
        queue_size: size,
        timeout: Duration::from_secs(2),
    };
    Gate::new(&spec, targets, Box::new(|_| true), handles())
}

fn ticket(key: u128) -> Ticket<'static> {
    // Each identity from an address of its own.
    Ticket {
        key,
        peer: key as u64,
        priority: Priority::Normal,
        tried: &[],
    }
}

#[tokio::test(start_paused = true)]
async fn requests_past_the_cap_wait_for_a_slot() {
    let g = gate(2, 10, 1);
    let a = g.admit(ticket(1)).await.unwrap();
    let _b = g.admit(ticket(1)).await.unwrap();
    let waiting = tokio::spawn({
        let g = g.clone();
        async move { g.admit(ticket(2)).await.map(|s| s.waited) }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!((g.stats().in_flight(), g.stats().queued), (2, 1));
    drop(a);
    let waited = waiting.await.unwrap().unwrap();
    assert_eq!(waited, Duration::from_millis(300));
    assert_eq!((g.stats().in_flight(), g.stats().queued), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_and_a_long_wait_are_refused() {
    let g = gate(1, 1, 1);
    let _a = g.admit(ticket(1)).await.unwrap();
    let waiting = tokio::spawn({
        let g = g.clone();
        async move { g.admit(ticket(1)).await.map(|_| ()) }
    });
    tokio::task::yield_now().await;
    let full = g.admit(ticket(2)).await.unwrap_err();
    assert_eq!(full.why, Refused::QueueFull);
    assert!(full.retry_after >= 1);
    let started = tokio::time::Instant::now();
    let late = waiting.await.unwrap().unwrap_err();
    assert_eq!(late.why, Refused::QueueTimeout);
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    assert_eq!(g.stats().queued, 0);
    assert_eq!(g.handles.refused.each_ref().map(Counter::get), [1, 1, 0]);
}

#[tokio::test(start_paused = true)]
async fn a_request_whose_client_left_leaves_the_queue_at_once() {
    let g = gate(1, 10, 1);
    let a = g.admit(ticket(1)).await.unwrap();
    let waiting = tokio::spawn({
        let g = g.clone();
        async move { g.admit(ticket(2)).await.map(|_| ()) }
    });
    tokio::task::yield_now().await;
    assert_eq!(g.stats().queued, 1);
    waiting.abort();
    let _ = waiting.await;
    assert_eq!(g.stats().queued, 0);
    drop(a);
    assert_eq!(
        g.stats().in_flight(),
        0,
        "no slot kept for the request that left"
    );
}

#[tokio::test(start_paused = true)]
async fn one_heavy_identity_delays_a_light_one_by_one_turn_at_most() {
    let g = gate(1, 1000, 1);
    let first = g.admit(ticket(1)).await.unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut tasks = Vec::new();
    for i in 0..100u32 {
        let (g, tx) = (g.clone(), tx.clone());
        let key = if i == 50 { 2 } else { 1 };
        tasks.push(tokio::spawn(async move {
            let slot = g.admit(ticket(key)).await.unwrap();
            tx.send(key).unwrap();
            tokio::time::sleep(Duration::from_millis(1)).await;
            drop(slot);
        }));
        tokio::task::yield_now().await;
    }
    drop(first);
    let mut order = Vec::new();
    for _ in 0..100 {
        order.push(rx.recv().await.unwrap());
    }
    let light = order.iter().position(|k| *k == 2).unwrap();
    assert!(light <= 1, "light identity served {light}th: {order:?}");
}

#[tokio::test(start_paused = true)]
async fn a_reload_that_raises_the_cap_lets_waiting_requests_go() {
    let g = gate(1, 10, 1);
    let _a = g.admit(ticket(1)).await.unwrap();
    let waiting = tokio::spawn({
        let g = g.clone();
        async move { g.admit(ticket(2)).await.map(|_| ()) }
    });
    tokio::task::yield_now().await;
    g.respec(&Spec {
        cap: Cap::Fixed(2),
        queue_size: 10,
        timeout: Duration::from_secs(2),
    });
    waiting.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_unhealthy_target_gets_no_slot_while_another_is_healthy() {
    let down = Arc::new(AtomicBool::new(true));
    let healthy = {
        let down = down.clone();
        Box::new(move |t: usize| t != 0 || !down.load(Ordering::Relaxed))
    };
    let spec = Spec {
        cap: Cap::Fixed(1),
        queue_size: 10,
        timeout: Duration::from_secs(2),
    };
    let g = Gate::new(&spec, 2, healthy, handles());
    let a = g.admit(ticket(1)).await.unwrap();
    assert_eq!(a.target, 1);
    let again = g.admit(ticket(1));
    tokio::pin!(again);
    assert!(
        tokio::time::timeout(Duration::from_millis(10), &mut again)
            .await
            .is_err(),
        "waits for target 1"
    );
    drop(a);
    assert_eq!(again.await.unwrap().target, 1);
    // A retry avoids the target it tried where another has room.
    down.store(false, Ordering::Relaxed);
    let tried = [1];
    let t = Ticket {
        key: 1,
        peer: 1,
        priority: Priority::Normal,
        tried: &tried,
    };
    assert_eq!(g.admit(t).await.unwrap().target, 0);
}

#[tokio::test(start_paused = true)]
async fn a_drain_answers_what_is_still_waiting_before_it_ends() {
    let g = gate(1, 10, 1);
    let _a = g.admit(ticket(1)).await.unwrap();
    let waiting = tokio::spawn({
        let g = g.clone();
        async move { g.admit(ticket(2)).await.map(|_| ()) }
    });
    tokio::task::yield_now().await;
    let started = tokio::time::Instant::now();
    g.close_by(started + Duration::from_millis(500));
    let refused = waiting.await.unwrap().unwrap_err();
    assert_eq!(refused.why, Refused::ShuttingDown);
    assert_eq!(started.elapsed(), Duration::from_millis(500));
    // A request that comes during the drain is told at once once the time is past.
    let late = g.admit(ticket(3)).await.unwrap_err();
    assert_eq!(late.why, Refused::ShuttingDown);
}

#[tokio::test(start_paused = true)]
async fn a_light_identity_pushes_a_heavy_one_out_of_a_full_queue() {
    let g = gate(1, 2, 1);
    let held = g.admit(ticket(1)).await.unwrap();
    let heavy: Vec<_> = (0..2)
        .map(|_| {
            let g = g.clone();
            tokio::spawn(async move { g.admit(ticket(1)).await.map(|_| ()) })
        })
        .collect();
    tokio::task::yield_now().await;
    assert_eq!(g.stats().queued, 2);
    let light = tokio::spawn({
        let g = g.clone();
        async move { g.admit(ticket(2)).await.map(|s| s.target) }
    });
    tokio::task::yield_now().await;
    assert_eq!(
        g.stats().queued,
        2,
        "the light request took a heavy one's place"
    );
    let mut outcomes = Vec::new();
    for h in heavy {
        if let Ok(result) = tokio::time::timeout(Duration::from_millis(10), h).await {
            outcomes.push(result.unwrap().unwrap_err().why);
        }
    }
    assert_eq!(outcomes, [Refused::QueueFull]);
    // Another heavy request now finds the queue full with nobody heavier to push out.
    assert_eq!(
        g.admit(ticket(1)).await.unwrap_err().why,
        Refused::QueueFull
    );
    drop(held);
    assert_eq!(light.await.unwrap().unwrap(), 0, "the light one is served");
}

#[tokio::test(start_paused = true)]
async fn a_retry_waits_for_a_target_it_has_not_tried() {
    // Target 0 failed this request; target 1 is full. The retry waits for 1, and a fresh
    // request behind it takes the free slot on 0 meanwhile.
    let g = gate(1, 10, 2);
    let on_one = g.admit(ticket(1)).await.unwrap();
    assert_eq!(on_one.target, 0);
    let on_two = g.admit(ticket(2)).await.unwrap();
    assert_eq!(on_two.target, 1);
    drop(on_one);
    let retry = tokio::spawn({
        let g = g.clone();
        async move {
            let tried = [0];
            let t = Ticket {
                key: 3,
                peer: 3,
                priority: Priority::Normal,
                tried: &tried,
            };
            g.admit(t).await.map(|s| s.target)
        }
    });
    tokio::task::yield_now().await;
    assert_eq!(g.stats().queued, 1, "the retry waits, target 0 has room");
    let fresh = g.admit(ticket(4)).await.unwrap();
    assert_eq!(fresh.target, 0);
    drop(on_two);
    assert_eq!(retry.await.unwrap().unwrap(), 1);
}
