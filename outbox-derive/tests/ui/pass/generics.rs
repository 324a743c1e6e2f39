use outbox_diesel::OutboxEvent;
use serde::Serialize;
use std::fmt::Display;

// The aggregate id's type is a parameter: the impl requires `Id: Display` (and, for the
// supertrait, whatever serde's impl requires).
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "account")]
struct Credited<Id, M>
where
    M: Clone,
{
    #[outbox(aggregate_id)]
    account: Id,
    meta: M,
}

// Lifetimes, const parameters, an id type that mentions no parameter, and bounds inline.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "sensor", event_type = "sensor.sampled")]
struct Sampled<'a, T: Serialize, const N: usize> {
    #[outbox(aggregate_id)]
    sensor: &'a str,
    #[serde(skip)]
    samples: [T; N],
}

// Generic enum, with an id type that wraps a parameter.
#[derive(Serialize, OutboxEvent)]
#[outbox(aggregate_type = "job")]
enum JobEvent<K: Display + Serialize> {
    Started(#[outbox(aggregate_id)] Box<K>),
    Finished {
        #[outbox(aggregate_id)]
        key: Box<K>,
        ok: bool,
    },
}

fn id_of<E: OutboxEvent>(event: &E) -> String {
    event.aggregate_id()
}

fn main() {
    let credited = Credited { account: 12_u32, meta: vec![1, 2] };
    assert_eq!(credited.aggregate_type(), "account");
    assert_eq!(credited.event_type(), "credited");
    assert_eq!(id_of(&credited), "12");
    assert_eq!(Credited::<String, ()>::event_types(), ["credited"]);
    assert_eq!(credited.meta.len(), 2);

    let sampled = Sampled { sensor: "s-1", samples: [1.5_f64, 2.5] };
    assert_eq!(id_of(&sampled), "s-1");
    assert_eq!(sampled.event_type(), "sensor.sampled");
    assert_eq!(sampled.samples.len(), 2);

    let job = JobEvent::Finished { key: Box::new("nightly"), ok: true };
    assert_eq!((job.event_type(), id_of(&job)), ("finished", "nightly".to_owned()));
    assert_eq!(JobEvent::Started(Box::new(3_u8)).aggregate_id(), "3");
    assert_eq!(JobEvent::<u8>::event_types(), ["started", "finished"]);
    if let JobEvent::Finished { ok, .. } = job {
        assert!(ok);
    }
}
