/* The HTTP router's policies in C: api/router/routing.py's Router and PrefixTree for byte prompts, and
 * api/router/http_router.py's _routing_of, decision for decision (tests/test_native_routing.py checks
 * them against the Python ones). Used by the compiled data plane (relay.c) from its thread; any
 * thread may read the load figures (route_requests, route_tokens) meanwhile. */
#ifndef ACTORSERVE_ROUTE_H
#define ACTORSERVE_ROUTE_H

#include <stddef.h>
#include <stdint.h>

/* The order of runtime/config.py's ROUTER_POLICIES. */
enum route_policy { ROUTE_CACHE_AWARE = 0, ROUTE_ROUND_ROBIN = 1, ROUTE_SHORTEST_QUEUE = 2, ROUTE_ROUTING_KEY = 3 };

typedef struct route_router route_router;

/* NULL when out of memory or a setting is out of range (RouterConfig has refused those already). */
route_router *route_new(int policy, int num_replicas, double cache_threshold, int64_t balance_abs_threshold,
                        double balance_rel_threshold, int64_t max_tree_tokens);
void route_free(route_router *router);

/* The replica for a request, or -1 when every replica is down. `key` is the routing key's UTF-8
 * bytes when `has_key`, else ignored. Cache-aware: the prompt is added to the chosen replica's tree. */
int route_choose(route_router *router, const uint8_t *prompt, size_t prompt_len, const uint8_t *key, size_t key_len,
                 int has_key);
void route_started(route_router *router, int replica, int64_t tokens);
void route_finished(route_router *router, int replica, int64_t tokens);
void route_set_healthy(route_router *router, int replica, int healthy);
int64_t route_requests(const route_router *router, int replica);
int64_t route_tokens(const route_router *router, int replica);
int64_t route_tree_size(const route_router *router, int replica); /* PrefixTree.size[replica] */

/* _routing_of(body): the prompt key (a slice of `body`: the raw JSON value of the first of
 * input_ids, prompt, text, messages present at the top level) and the routing key (the decoded
 * UTF-8 of a top-level string "routing_key", into key_buf). Returns 1 when it has a routing key
 * (*key_len set; 0 when absent, not a string, or longer than key_cap). A body that is not a valid
 * JSON object gives an empty prompt (*prompt_len 0) and no key. */
int route_fields(const uint8_t *body, size_t body_len, const uint8_t **prompt, size_t *prompt_len, uint8_t *key_buf,
                 size_t key_cap, size_t *key_len);

#endif
