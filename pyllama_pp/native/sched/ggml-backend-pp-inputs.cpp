// pyllama_pp: EARLY_INPUTS - user inputs uploaded at the start of a graph, one device copy for the graphs in
// flight; and the copy-slot waits and events of a pipelined graph.

#include "ggml-backend-pp-impl.h"

// EARLY_INPUTS: a user input (token ids, positions, the KQ mask, ...) gets one device copy for all graphs in
// flight instead of one per copy index. While a graph is in flight the early upload writes it
// with an async set on that device's own stream, after everything the graphs before queued there - including
// their reads of this copy - so no second copy is needed for it. (Activations crossing devices keep their copies:
// another backend's stream writes them.) Only for a backend whose async set is queued on its stream.
bool ggml_backend_sched_pp_shared_input(ggml_backend_sched_t sched, const struct ggml_tensor * src, int backend_id) {
    return sched->n_copies > 1 && (src->flags & GGML_TENSOR_FLAG_INPUT) &&
           sched->backends[backend_id]->iface.set_tensor_async != NULL &&
           sched->pp_cfg.early_inputs != 0;
}

// before a user input is copied synchronously into its split's copy slot
void ggml_backend_sched_pp_wait_user_input(ggml_backend_sched_t sched, ggml_sched_pp_graph * g, int split_id,
                                           struct ggml_tensor * input) {
    const int backend_id = sched->splits[split_id].backend_id;
    if (ggml_backend_sched_pp_wait_slot(sched, backend_id, /*on_host =*/ true, g->idle)) {
        sched->pp.input_host_waits++;
    }
    if (sched->pp_in_flight > 0 && sched->n_copies > 1 &&
        tensor_copy(input, backend_id, 0) == tensor_copy(input, backend_id, 1)) {
        // a shared copy (SHARED_INPUTS) written outside the early upload while a graph may be in
        // flight: the graphs before may still read it on this backend
        ggml_backend_synchronize(sched->backends[backend_id]);
    }
}

// before a device-to-device copy into the copy slot of backend_id: such a copy runs on the SOURCE stream, which
// the wait on the destination does not order: let the source wait too until the destination has finished the
// graph that used this copy slot - with fewer copies than upstream's 4 the source stage could otherwise
// overwrite an input still being read
void ggml_backend_sched_pp_wait_source(ggml_backend_sched_t sched, ggml_sched_pp_graph * g, int backend_id,
                                       ggml_backend_t input_backend) {
    ggml_backend_t split_backend = sched->backends[backend_id];
    if (!g->idle && sched->n_copies < GGML_SCHED_MAX_COPIES && input_backend != split_backend &&
        input_backend->iface.event_wait != NULL && split_backend->iface.cpy_tensor_async != NULL &&
        sched->events[backend_id][sched->cur_copy] != NULL) {
        ggml_backend_event_wait(input_backend, sched->events[backend_id][sched->cur_copy]);
    }
}

// LAST_EVENTS: whether a split records its event - only where it is waited for: after a backend's last split of
// the graph, which is what a later graph using the same copy slot waits for, and before a split without inputs
// on another backend. Within one graph the other waits are on the backend's own stream or on copy slots no
// earlier split of the graph reads, so the intermediate records only cost time, e.g. per token in decode.
bool ggml_backend_sched_pp_record_event(ggml_backend_sched_t sched, const ggml_sched_pp_graph * g, int split_id) {
    const struct ggml_backend_sched_split * splits = sched->splits;
    const int backend_id = splits[split_id].backend_id;
    return !g->last_events || split_id == g->last_split[backend_id] ||
           (split_id + 1 < sched->n_splits && splits[split_id + 1].n_inputs == 0 &&
            splits[split_id + 1].backend_id != backend_id);
}

// before a graph is allocated into copy slot cur_copy: the early input uploads of an older graph into it must be done
void ggml_backend_sched_pp_wait_input_events(ggml_backend_sched_t sched) {
    for (int b = 0; b < sched->n_backends; b++) {
        if (sched->input_events_pending[b][sched->cur_copy]) {
            GGML_SCHED_PP_WAIT(sched, GGML_SCHED_PP_WAIT_INPUT_EVENTS);
            ggml_backend_event_synchronize(sched->input_events[b][sched->cur_copy]);
            sched->input_events_pending[b][sched->cur_copy] = false;
            sched->pp.input_event_syncs++;
        }
    }
}

// user inputs that go to this split backend in the early upload at the start of the graph; only while a previous
// graph is in flight: with nothing in flight (decode, where llama synchronizes every token) the per-split copy
// waits for nothing, and the extra events would only add work
bool ggml_backend_sched_pp_early_input(ggml_backend_sched_t sched, int backend_id, const struct ggml_tensor * input) {
    return sched->n_copies > 1 && sched->pp_in_flight > 0 && sched->pp_cfg.early_inputs != 0 &&
           (input->flags & GGML_TENSOR_FLAG_INPUT) && input->buffer != NULL && ggml_backend_buffer_is_host(input->buffer) &&
           sched->events[backend_id][sched->cur_copy] != NULL && sched->input_events[backend_id][sched->cur_copy] != NULL;
}

// Upload the user inputs of every split at the start of the graph, each on its backend's stream after that
// backend has finished the graph that last used the same copy slot (a device-side wait, not a host one).
// The host waits for these uploads only when it is about to overwrite the inputs of that copy again
// (ggml_backend_sched_alloc_graph), instead of blocking before each first use mid-graph.
void ggml_backend_sched_pp_upload_inputs(ggml_backend_sched_t sched) {
    bool waited[GGML_SCHED_MAX_BACKENDS] = { false };
    for (int split_id = 0; split_id < sched->n_splits; split_id++) {
        const struct ggml_backend_sched_split * split = &sched->splits[split_id];
        const int b = split->backend_id;
        for (int i = 0; i < split->n_inputs; i++) {
            struct ggml_tensor * input = split->inputs[i];
            if (!ggml_backend_sched_pp_early_input(sched, b, input)) {
                continue;
            }
            if (!waited[b]) {
                ggml_backend_event_wait(sched->backends[b], sched->events[b][sched->cur_copy]);
                sched->pp.input_device_waits++;
                waited[b] = true;
            }
            struct ggml_tensor * input_cpy = tensor_copy(input, b, sched->cur_copy);
            ggml_backend_tensor_set_async(sched->backends[b], input_cpy, input->data, 0, ggml_nbytes(input));
            sched->pp.input_early_uploads++;
        }
    }
    for (int b = 0; b < sched->n_backends; b++) {
        if (waited[b]) {
            ggml_backend_event_record(sched->input_events[b][sched->cur_copy], sched->backends[b]);
            sched->input_events_pending[b][sched->cur_copy] = true;
        }
    }
}

// Before a copy overwrites this backend's copy slot: wait until no older graph still reads it, on the host (a
// synchronous copy follows) or on the backend's stream (an asynchronous one). With nothing in flight (idle)
// there is nothing to wait for. Returns whether it waited on the slot's event.
bool ggml_backend_sched_pp_wait_slot(ggml_backend_sched_t sched, int backend_id, bool on_host, bool idle) {
    ggml_backend_event_t ev = sched->events[backend_id][sched->cur_copy];
    if (ev == NULL) {
        ggml_backend_synchronize(sched->backends[backend_id]);
        return false;
    }
    if (idle) {
        return false;
    }
    if (on_host) {
        ggml_backend_event_synchronize(ev);
    } else {
        ggml_backend_event_wait(sched->backends[backend_id], ev);
    }
    return true;
}
