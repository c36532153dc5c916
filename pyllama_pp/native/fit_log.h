// What common/fit.cpp logged during one pp_fit call (fit_log.cpp).
#pragma once

#include <string>
#include <utility>
#include <vector>

struct pp_fit_log {
    std::vector<std::pair<std::string, std::string>> records;   // LOG_JSON records: (type, JSON text)
    std::string last_warning;                                     // the last warning/error line (a refusal's reason)
};

void       pp_fit_log_begin();
pp_fit_log pp_fit_log_end();
